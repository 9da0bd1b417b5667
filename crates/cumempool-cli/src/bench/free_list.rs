//! The reference the cache is held to: a plain thread-local free list, a `Vec` per power of two,
//! each thread its own, no lock. What a pair costs when nothing is shared and nothing checked.

use std::cell::RefCell;

thread_local! {
    static FREE_LISTS: RefCell<Vec<Vec<u64>>> = RefCell::new((0..64).map(|_| Vec::with_capacity(64)).collect());
}

/// One allocation+free pair from this thread's free lists: pop a block of the size's class (or
/// make one up), push it back. Blocks are numbers, never memory: only the lists' own work is
/// timed.
#[inline(always)]
pub(super) fn free_list_pair(bytes: usize) -> bool {
    FREE_LISTS.with(|lists| {
        let mut lists = lists.borrow_mut();
        let class = bytes.next_power_of_two().trailing_zeros() as usize;
        let Some(list) = lists.get_mut(class) else { return false };
        let block = list.pop().unwrap_or(bytes as u64);
        list.push(std::hint::black_box(block));
        true
    })
}
