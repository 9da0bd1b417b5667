//! Size classes: 256 B, then four per power of two up to 1 TiB; larger requests bypass the
//! cache. Every class block is allocated below with the class's bytes.

const MIN_SHIFT: u32 = 8;
const MAX_SHIFT: u32 = 40;
const STEPS: u32 = 4;
/// How many size classes there are; every index [`size_class`] answers is below it.
pub(super) const CLASSES: usize = 1 + ((MAX_SHIFT - MIN_SHIFT) * STEPS) as usize;

// What `size_class`'s reading of an `f64` rests on: a whole number of mantissa bits per step,
// every class's bytes exact in an `f64`, and in a `usize` (CUDA 13 has 64-bit hosts only).
const _: () = assert!(STEPS.is_power_of_two() && MAX_SHIFT < f64::MANTISSA_DIGITS && usize::BITS >= 64);

/// The size class of a request: (index, bytes), with at most 25% rounding above 256 B.
///
/// On every hot path, so without branches but one. The class is read off the exponent and the
/// two mantissa bits below the leading one of `bytes - 1` as an `f64`: shifted down to those,
/// its bits are `4 * (1023 + log2) + step`, with `step` the quarter of the power of two the
/// request falls in, which is the index offset by a constant. The conversion is exact below 2^53,
/// and above it rounds up to an exponent that is too large anyway. Requests up to 256 B are
/// raised to 255 + 1 first, which falls in class 0; 0 bytes wraps to a negative number, whose
/// sign bit makes the index too large too. One unsigned comparison so rejects every request
/// beyond the classes and tells the compiler the index is below [`CLASSES`], which spares every
/// lookup by class a bounds check.
#[inline(always)]
pub(super) fn size_class(bytes: usize) -> Option<(usize, usize)> {
    let below = (bytes as u64).wrapping_sub(1).max((1 << MIN_SHIFT) - 1);
    // `as i64`: a signed conversion is one instruction; values of 2^63 and more turn negative.
    let quarters = (below as i64 as f64).to_bits() >> (f64::MANTISSA_DIGITS - 1 - STEPS.ilog2());
    let index = quarters.wrapping_sub(FIRST_QUARTERS) as usize;
    if index >= CLASSES {
        return None;
    }
    Some((index, CLASS_BYTES[index]))
}

/// The exponent and two leading mantissa bits of 255.0, as `size_class` shifts them: class 0.
const FIRST_QUARTERS: u64 = (1023 + MIN_SHIFT as u64 - 1) * STEPS as u64 + (STEPS as u64 - 1);

/// The bytes of every size class, so that the hot path reads them with one load. A `const`, not
/// a `static`: each crate the hot path is inlined into gets its own copy, which it addresses
/// directly rather than through the global offset table, and which the compiler knows cannot
/// change, so a free inlined after an allocation reuses the bytes the allocation read.
const CLASS_BYTES: [usize; CLASSES] = {
    let mut bytes = [0; CLASSES];
    let mut index = 0;
    while index < CLASSES {
        bytes[index] = class_bytes_of(index);
        index += 1;
    }
    bytes
};

/// The bytes of size class `index`.
pub(super) fn class_bytes(index: usize) -> usize {
    CLASS_BYTES.get(index).copied().unwrap_or_else(|| class_bytes_of(index))
}

/// The bytes of size class `index`, computed.
const fn class_bytes_of(index: usize) -> usize {
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
        assert_eq!(size_class(0), None);
        assert_eq!(size_class(usize::MAX), None);
    }

    /// The float reading against the integer arithmetic it replaces, around every class edge
    /// and across the whole range (where the conversion rounds).
    #[test]
    fn the_float_reading_agrees_with_integer_arithmetic() {
        fn integer(bytes: usize) -> Option<(usize, usize)> {
            let below = (bytes as u64).wrapping_sub(1).max((1 << MIN_SHIFT) - 1);
            let log = 63 - below.leading_zeros();
            if log >= MAX_SHIFT {
                return None;
            }
            let step = (below >> (log - 2)) + 1;
            let index = (log * STEPS + step as u32) - (MIN_SHIFT * STEPS + 4);
            Some((index as usize, (step << (log - 2)) as usize))
        }
        let edges = (0..64u32).flat_map(|shift| {
            (4..=8u64).flat_map(move |step| {
                let edge = (step << shift) >> 2;
                [edge.wrapping_sub(1), edge, edge.wrapping_add(1)]
            })
        });
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let random = std::iter::repeat_with(move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x >> (x % 64)
        });
        for bytes in (0..4096).chain(edges).chain(random.take(100_000)).chain([u64::MAX, 1 << 63, (1 << 53) + 1]) {
            assert_eq!(size_class(bytes as usize), integer(bytes as usize), "{bytes}");
        }
    }
}
