"""`cumempool.torch.mem_pool` with PyTorch: pools over different sources side by side."""

import cumempool as cm
from conftest import library


def test_torch_pools_over_two_sources_each_allocate_from_their_own(gpu):
    torch = library("torch")
    import cumempool.torch as cmt

    a = cm.Statistics(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
    b = cm.Statistics(cm.CachingResource(cm.PoolResource(cm.MemPool(cm.Route.device(0)))))
    pool_a = cmt.mem_pool(a)
    pool_b = cmt.mem_pool(b)  # made after pool_a: pool_a must keep allocating from `a`
    try:
        with torch.cuda.use_mem_pool(pool_a):
            x = torch.ones(1 << 18, device="cuda")
        used_a = a.usage()["current_bytes"]
        assert used_a >= 1 << 20, "pool_a did not allocate from a"
        assert b.usage()["current_bytes"] == 0, "pool_a allocated from b, the source of a later pool"
        with torch.cuda.use_mem_pool(pool_b):
            y = torch.full((1 << 19,), 2.0, device="cuda")
        assert b.usage()["current_bytes"] >= 2 << 20, "pool_b did not allocate from b"
        with torch.cuda.use_mem_pool(pool_a):
            z = torch.ones(8 << 20, device="cuda")
        assert a.usage()["current_bytes"] >= used_a + (32 << 20), "pool_a's second tensor came from elsewhere"
        assert cmt.statistics(pool_a)["current_bytes"] == a.usage()["current_bytes"]
        assert cmt.statistics(pool_b)["current_bytes"] == b.usage()["current_bytes"]
        assert float(x.sum()) == float(1 << 18) and float(y.sum()) == float(1 << 20)
        assert float(z.sum()) == float(8 << 20)
        del x, y, z
        torch.cuda.synchronize()
    finally:
        del pool_a, pool_b
        torch.cuda.empty_cache()
        cmt.stop()
    # PyTorch gave each pool's segments back when the pool went: each to its own source.
    assert a.usage()["current_bytes"] == 0 and b.usage()["current_bytes"] == 0
