//! The macros that instantiate the microkernels for a run-time number of lanes and tiles.

/// Dispatches a run-time lane count (1 to 8) to a kernel instantiated for it: the AVX-512
/// microkernels (`micro`, `bf16`) take up to 8 lanes.
/// (`$f::<T; _, C>` passes a leading type parameter `T` through.)
macro_rules! by_lanes {
    ($lanes:expr, $f:ident :: <_, $c:tt>($($arg:expr),*)) => {
        by_lanes!(@ $lanes, $f, [], $c, ($($arg),*))
    };
    ($lanes:expr, $f:ident :: <$t:ty; _, $c:tt>($($arg:expr),*)) => {
        by_lanes!(@ $lanes, $f, [$t,], $c, ($($arg),*))
    };
    (@ $lanes:expr, $f:ident, [$($t:ty,)?], $c:tt, ($($arg:expr),*)) => {
        match $lanes {
            1 => $f::<$($t,)? 1, $c>($($arg),*),
            2 => $f::<$($t,)? 2, $c>($($arg),*),
            3 => $f::<$($t,)? 3, $c>($($arg),*),
            4 => $f::<$($t,)? 4, $c>($($arg),*),
            5 => $f::<$($t,)? 5, $c>($($arg),*),
            6 => $f::<$($t,)? 6, $c>($($arg),*),
            7 => $f::<$($t,)? 7, $c>($($arg),*),
            _ => $f::<$($t,)? 8, $c>($($arg),*),
        }
    };
}

/// The same for the AVX2 kernels (`micro`'s AVX2 module, `in_place`), which take up to 4 lanes,
/// and `int8`'s packed score tiles.
macro_rules! by_lanes4 {
    ($lanes:expr, $f:ident ($($arg:expr),*)) => {
        match $lanes {
            1 => $f::<1>($($arg),*),
            2 => $f::<2>($($arg),*),
            3 => $f::<3>($($arg),*),
            _ => $f::<4>($($arg),*),
        }
    };
    // (`$f::<T; _, C>` as for `by_lanes`.)
    ($lanes:expr, $f:ident :: <$t:ty; _, $c:tt>($($arg:expr),*)) => {
        match $lanes {
            1 => $f::<$t, 1, $c>($($arg),*),
            2 => $f::<$t, 2, $c>($($arg),*),
            3 => $f::<$t, 3, $c>($($arg),*),
            _ => $f::<$t, 4, $c>($($arg),*),
        }
    };
}

/// Runs `$f::<L, C>(args)` across columns `0..$n` (a multiple of 16) in tiles of 32 columns
/// (`C` = 2 vectors) and a last one of 16 (`C` = 1), `$at` naming the tile's first column, with
/// the run-time lane count made the constant `L` ([`by_lanes`]).
macro_rules! by_tiles {
    ($lanes:expr, $n:expr, $at:ident => $f:ident($($arg:expr),*)) => {
        by_tiles!(@ $lanes, $n, $at, $f, [], ($($arg),*))
    };
    ($lanes:expr, $n:expr, $at:ident => $f:ident :: <$t:ty>($($arg:expr),*)) => {
        by_tiles!(@ $lanes, $n, $at, $f, [$t,], ($($arg),*))
    };
    (@ $lanes:expr, $n:expr, $at:ident, $f:ident, [$($t:ty,)?], ($($arg:expr),*)) => {{
        let mut $at = 0;
        while $at + 32 <= $n {
            by_lanes!(@ $lanes, $f, [$($t,)?], 2, ($($arg),*));
            $at += 32;
        }
        if $at < $n {
            by_lanes!(@ $lanes, $f, [$($t,)?], 1, ($($arg),*));
        }
    }};
}
