//! One wrapper per entry point of the bindings, generated from the bindings' own list
//! (`cumempool_sys::for_each_entry_point!`), so a function added there is covered here without
//! code written for it.
//!
//! Each wrapper is the same generic function, instantiated per entry (`const I`, its index in
//! [`crate::entry_points`]) and per signature (one impl of [`Wrap`] per arity): it asks the plan
//! whether this call fails and otherwise calls the real driver's pointer for entry `I`.

use crate::entry_points::COUNT;
use crate::injection;
use cumempool_sys::CUresult;
use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};

macro_rules! entry_table {
    ($($name:ident: $pfn:ty = $since:literal,)*) => {
        /// Every entry point of the bindings, in their order, so `Entry::x as usize` is x's
        /// index in [`crate::entry_points::NAMES`].
        #[allow(non_camel_case_types, dead_code)]
        #[derive(Clone, Copy)]
        enum Entry { $($name,)* }

        /// The wrapper of the entry point `name`, as the untyped pointer `cuGetProcAddress` hands out.
        fn wrapper_of(name: &[u8]) -> Option<(usize, *mut c_void)> {
            $(
                if name == stringify!($name).as_bytes() {
                    return Some((Entry::$name as usize, <$pfn as Wrap>::wrapper::<{ Entry::$name as usize }>()));
                }
            )*
            None
        }
    };
}
cumempool_sys::for_each_entry_point!(entry_table);

/// The real driver's pointer for each entry, as first handed out; null until resolved.
static REAL: [AtomicPtr<c_void>; COUNT] = [const { AtomicPtr::new(ptr::null_mut()) }; COUNT];

/// Puts the wrapper of `name` in place of the real pointer `real`, remembering `real`.
///
/// The first pointer resolved for an entry wins: the loader asks each function once, at the
/// version whose ABI the bindings declare. A later request that hands out another pointer
/// (a probe at another version, with another ABI) is left unwrapped, so a wrapper never calls
/// a function of a signature other than its own.
pub(crate) fn wrap(name: &[u8], real: *mut c_void) -> *mut c_void {
    let Some((index, wrapper)) = wrapper_of(name) else {
        return real;
    };
    match REAL[index].compare_exchange(ptr::null_mut(), real, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => wrapper,
        Err(first) if first == real => wrapper,
        Err(_) => real,
    }
}

/// A driver function-pointer type that has a wrapper.
trait Wrap {
    /// The wrapper for entry `I`, untyped.
    fn wrapper<const I: usize>() -> *mut c_void;
}

macro_rules! wrap_arity {
    ($($arg:ident: $ty:ident),*) => {
        impl<$($ty: 'static),*> Wrap for unsafe extern "C" fn($($ty),*) -> CUresult {
            fn wrapper<const I: usize>() -> *mut c_void {
                #[allow(clippy::too_many_arguments)]
                unsafe extern "C" fn wrapped<const I: usize, $($ty),*>($($arg: $ty),*) -> CUresult {
                    if let Some(code) = injection::decide(I) {
                        return CUresult(code);
                    }
                    let real = REAL[I].load(Ordering::Acquire);
                    if real.is_null() {
                        return CUresult::CUDA_ERROR_NOT_INITIALIZED;
                    }
                    // SAFETY: `wrap` stored the driver's pointer for entry I, handed out at the
                    // ABI of I's declared type, which is this function's signature.
                    let real = unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) -> CUresult>(real) };
                    // SAFETY: the caller holds the driver function's contract; the arguments pass through.
                    unsafe { real($($arg),*) }
                }
                wrapped::<I, $($ty),*> as unsafe extern "C" fn($($ty),*) -> CUresult as *mut c_void
            }
        }
    };
}

wrap_arity!();
wrap_arity!(a: A);
wrap_arity!(a: A, b: B);
wrap_arity!(a: A, b: B, c: C);
wrap_arity!(a: A, b: B, c: C, d: D);
wrap_arity!(a: A, b: B, c: C, d: D, e: E);
wrap_arity!(a: A, b: B, c: C, d: D, e: E, f: F);
wrap_arity!(a: A, b: B, c: C, d: D, e: E, f: F, g: G);
wrap_arity!(a: A, b: B, c: C, d: D, e: E, f: F, g: G, h: H);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry_points::index_of;

    #[test]
    fn every_entry_point_of_the_bindings_has_a_wrapper() {
        assert_eq!(COUNT, cumempool_sys::ENTRY_POINTS.len());
        for entry in cumempool_sys::ENTRY_POINTS {
            assert!(wrapper_of(entry.name.as_bytes()).is_some(), "{} has no wrapper", entry.name);
        }
    }

    #[test]
    fn each_wrapper_counts_under_its_own_entry_points_index() {
        for entry in cumempool_sys::ENTRY_POINTS {
            let wrapped = wrapper_of(entry.name.as_bytes()).map(|(index, _)| index);
            assert_eq!(wrapped, index_of(entry.name), "{}", entry.name);
        }
    }
}
