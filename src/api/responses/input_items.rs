//! `GET /v1/responses/{id}/input_items`: the items a stored response was generated from,
//! earlier turns' inputs and outputs included (what `previous_response_id` chained in), as
//! OpenAI lists them: pages of at most 100, newest first unless `order=asc`, with `after` and
//! `before` item-id cursors.

use super::super::auth::Authorized;
use super::super::errors::ApiError;
use super::super::types::ErrorResponse;
use super::super::AppState;
use super::stored;
use actix_web::{web, HttpResponse};
use serde::Deserialize;
use serde_json::{json, Value};

/// Items a page holds when `limit` is not given, and at most.
const DEFAULT_LIMIT: usize = 20;
const MAX_LIMIT: usize = 100;

#[derive(Debug, Default, Deserialize)]
pub struct InputItemsQuery {
    pub limit: Option<usize>,
    /// `asc` (oldest first) or `desc` (the default).
    pub order: Option<String>,
    /// An item id: the page starts after it, in `order`.
    pub after: Option<String>,
    /// An item id: the page ends before it, in `order`.
    pub before: Option<String>,
}

/// The input items of a stored response.
#[utoipa::path(get, path = "/v1/responses/{id}/input_items", params(
    ("id" = String, Path),
    ("limit" = Option<usize>, Query, description = "1 to 100 (default 20)"),
    ("order" = Option<String>, Query, description = "`asc` or `desc` (default)"),
    ("after" = Option<String>, Query, description = "An item id: list the items after it"),
    ("before" = Option<String>, Query, description = "An item id: list the items before it"),
), responses(
    (status = 200, description = "`{object: \"list\", data: [item], first_id, last_id, has_more}`", body = Object),
    (status = 400, description = "A `limit`, `order` or cursor out of range", body = ErrorResponse),
    (status = 401, body = ErrorResponse),
    (status = 404, body = ErrorResponse),
))]
pub async fn list_input_items(
    auth: Authorized,
    id: web::Path<String>,
    query: web::Query<InputItemsQuery>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let entry = stored(&state, &auth.scope, &id)?;
    Ok(HttpResponse::Ok().json(page(&entry.input_items.items(), &query)?))
}

/// One page of `items` (oldest first) as `query` asks.
fn page(items: &[&Value], query: &InputItemsQuery) -> Result<Value, ApiError> {
    let limit = query.limit.unwrap_or(DEFAULT_LIMIT);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(ApiError::invalid(
            Some("limit"),
            format!("`limit` must be between 1 and {MAX_LIMIT}, not {limit}."),
        ));
    }
    let mut ordered = items.to_vec();
    match query.order.as_deref().unwrap_or("desc") {
        "desc" => ordered.reverse(),
        "asc" => {}
        other => {
            return Err(ApiError::invalid(
                Some("order"),
                format!("`order` must be `asc` or `desc`, not `{other}`."),
            ))
        }
    }
    let position = |param: &str, id: &str| {
        ordered
            .iter()
            .position(|item| item["id"] == id)
            .ok_or_else(|| {
                ApiError::invalid(
                    Some(param),
                    format!("No input item with id `{id}` in this response."),
                )
            })
    };
    let start = match &query.after {
        Some(id) => position("after", id)? + 1,
        None => 0,
    };
    let end = match &query.before {
        Some(id) => position("before", id)?,
        None => ordered.len(),
    };
    let window = &ordered[start.min(end)..end];
    // A `before` cursor alone pages backwards: the items right before it.
    let data = if query.before.is_some() && query.after.is_none() {
        &window[window.len().saturating_sub(limit)..]
    } else {
        &window[..window.len().min(limit)]
    };
    Ok(json!({
        "object": "list",
        "data": data,
        "first_id": data.first().map(|item| &item["id"]),
        "last_id": data.last().map(|item| &item["id"]),
        "has_more": data.len() < window.len(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(n: usize) -> Vec<Value> {
        (0..n).map(|i| json!({"id": format!("i{i}")})).collect()
    }

    fn page(items: &[Value], query: &InputItemsQuery) -> Result<Value, ApiError> {
        super::page(&items.iter().collect::<Vec<_>>(), query)
    }

    fn ids(page: &Value) -> Vec<&str> {
        page["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|item| item["id"].as_str().unwrap())
            .collect()
    }

    fn query(
        limit: Option<usize>,
        order: &str,
        after: Option<&str>,
        before: Option<&str>,
    ) -> InputItemsQuery {
        InputItemsQuery {
            limit,
            order: Some(order.into()),
            after: after.map(Into::into),
            before: before.map(Into::into),
        }
    }

    #[test]
    fn pages_run_newest_first_by_default_and_follow_their_cursors() {
        let all = items(5);
        let first = page(
            &all,
            &InputItemsQuery {
                limit: Some(2),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(ids(&first), ["i4", "i3"]);
        assert_eq!(first["has_more"], true);
        assert_eq!(first["first_id"], "i4");
        assert_eq!(first["last_id"], "i3");
        let next = page(&all, &query(Some(2), "desc", Some("i3"), None)).unwrap();
        assert_eq!(ids(&next), ["i2", "i1"]);
        let last = page(&all, &query(Some(2), "desc", Some("i1"), None)).unwrap();
        assert_eq!(ids(&last), ["i0"]);
        assert_eq!(last["has_more"], false);
        let asc = page(&all, &query(None, "asc", None, None)).unwrap();
        assert_eq!(ids(&asc), ["i0", "i1", "i2", "i3", "i4"]);
        assert_eq!(asc["has_more"], false);
        let back = page(&all, &query(Some(2), "asc", None, Some("i4"))).unwrap();
        assert_eq!(ids(&back), ["i2", "i3"]);
        assert_eq!(back["has_more"], true);
        let between = page(&all, &query(Some(10), "asc", Some("i0"), Some("i3"))).unwrap();
        assert_eq!(ids(&between), ["i1", "i2"]);
        let empty = page(&[], &InputItemsQuery::default()).unwrap();
        assert_eq!(ids(&empty), Vec::<&str>::new());
        assert!(empty["first_id"].is_null());
    }

    #[test]
    fn a_bad_limit_order_or_cursor_is_named() {
        let all = items(3);
        for (q, param) in [
            (query(Some(0), "asc", None, None), "limit"),
            (query(Some(101), "asc", None, None), "limit"),
            (query(None, "newest", None, None), "order"),
            (query(None, "asc", Some("nope"), None), "after"),
            (query(None, "asc", None, Some("nope")), "before"),
        ] {
            let e = page(&all, &q).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param));
        }
    }
}
