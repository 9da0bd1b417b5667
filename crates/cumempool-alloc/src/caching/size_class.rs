//! Size classes: 256 B, then four per power of two up to 1 TiB; larger requests bypass the
//! cache. Every class block is allocated below with the class's bytes.

const MIN_SHIFT: u32 = 8;
const MAX_SHIFT: u32 = 40;
const STEPS: u32 = 4;
/// How many size classes there are; every index [`size_class`] answers is below it.
pub(super) const CLASSES: usize = 1 + ((MAX_SHIFT - MIN_SHIFT) * STEPS) as usize;

/// The size class of a request: (index, bytes), with at most 25% rounding above 256 B.
///
/// On every hot path, so without branches but one: requests up to 256 B are raised to 255 + 1,
/// which the same arithmetic as the rest puts in class 0.
#[inline(always)]
pub(super) fn size_class(bytes: usize) -> Option<(usize, usize)> {
    let below = (bytes as u64).wrapping_sub(1).max((1 << MIN_SHIFT) - 1);
    let log = 63 - below.leading_zeros(); // at least MIN_SHIFT - 1
    if log >= MAX_SHIFT {
        return None;
    }
    let shift = log - 2;
    let step = (below >> shift) + 1; // 5..=8
                                     // 1 + (log - MIN_SHIFT) * STEPS + (step - 5), with log = MIN_SHIFT - 1, step = 8 giving 0.
    let index = (log * STEPS + step as u32) - (MIN_SHIFT * STEPS + 4);
    // At most `CLASSES - 1` already (log < MAX_SHIFT, step <= 8); the bound, stated where the
    // compiler can see it, spares every lookup by class a bounds check.
    Some(((index as usize).min(CLASSES - 1), (step << shift) as usize))
}

/// The bytes of size class `index`.
pub(super) fn class_bytes(index: usize) -> usize {
    if index == 0 {
        return 1 << MIN_SHIFT;
    }
    let i = index as u32 - 1;
    let log = MIN_SHIFT + i / STEPS;
    (((5 + i % STEPS) as u64) << (log - 2)) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_cover_every_size_with_little_rounding() {
        let mut last = 0;
        for bytes in (1..70_000).chain([1 << 20, (1 << 20) + 1, 3 << 30, (1 << 40) - 1]) {
            let (index, class) = size_class(bytes).expect("in range");
            assert!(class >= bytes, "{bytes} -> {class}");
            assert!(bytes <= 256 || class as f64 <= bytes as f64 * 1.25 + 1.0, "{bytes} -> {class}");
            assert_eq!(class_bytes(index), class, "index {index}");
            assert!(index < CLASSES && index >= last.min(index));
            last = index;
        }
        assert_eq!(size_class(1 << 40), Some((CLASSES - 1, 1 << 40)));
        assert_eq!(size_class((1 << 40) + 1), None);
        assert_eq!(size_class(257), Some((1, 320)));
        assert_eq!(size_class(512), Some((4, 512)));
        assert_eq!(size_class(513), Some((5, 640)));
    }
}
