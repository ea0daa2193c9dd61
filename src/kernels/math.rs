//! Scalar math shared by the sampler and attention, written so that loops over slices of it
//! vectorise.

/// `e^x` for `x <= 0`, branch-free (Cephes `expf`: Cody–Waite reduction to `|r| <= ln2/2`, a
/// degree-7 polynomial, then scaling by `2^n` through the exponent bits). Relative error below
/// 3e-7. Returns 0 for `x <= -87` (where `e^x` is below the smallest normal f32), for `-inf` and
/// for NaN; positive `x` is treated as 0.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    const MIN_X: f32 = -87.0;
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer.
    const C1: f32 = 0.693_359_4; // ln 2 split so that n · C1 is exact
    const C2: f32 = -2.121_944_4e-4;
    let live = x > MIN_X;
    let x = if live { x } else { MIN_X };
    let x = if x < 0.0 { x } else { 0.0 };
    let shifted = x * std::f32::consts::LOG2_E + MAGIC;
    let n = shifted - MAGIC;
    let n_bits = (shifted.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let r = x - n * C1 - n * C2;
    let poly = ((((1.987_569_2e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e_r = poly * r * r + r + 1.0;
    let scale = f32::from_bits(((n_bits + 127) as u32) << 23);
    if live {
        e_r * scale
    } else {
        0.0
    }
}
