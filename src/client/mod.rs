//! Clients of mtpx's own server, for tests, `mtpx bench` and `mtpx chat`.

pub mod ws;
