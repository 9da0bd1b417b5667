"""The PyTorch plug-in's exported C functions, called as PyTorch calls them, on the stand-in
libcuda of the Rust tests (no GPU, no torch)."""

from test_fake_driver import TORCH_FUNCTIONS, _run_after


def test_a_free_uses_the_size_recorded_at_allocation(stand_in_libcuda):
    # A wrong size from the caller would file the block under another size class of the cache
    # (and count the wrong bytes): the size recorded at allocation is used.
    lines = _run_after(
        stand_in_libcuda,
        TORCH_FUNCTIONS,
        """
        cache = cm.CachingResource(cm.PoolResource(pool))
        stats = cmt.serve(cache)
        p = lib.cumempool_torch_alloc(1 << 20, 0, None)
        lib.cumempool_torch_free(p, 64, 0, None)
        print(stats.usage()["current_bytes"])
        again = lib.cumempool_torch_alloc(1 << 20, 0, None)
        print(again == p)
        lib.cumempool_torch_free(again, 1 << 20, 0, None)
        lib.cumempool_torch_free(again, 1 << 20, 0, None)  # twice: unknown, ignored
        print(stats.usage()["current_bytes"])
        cmt.stop()
        """,
    )
    assert lines == ["0", "True", "0"], "the free trusted the size it was given"
