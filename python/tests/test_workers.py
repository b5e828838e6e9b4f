"""The module's shared worker pools (kvq.worker_pools()): a call with threads=n >= 2 runs on a
pool of n workers started once, the result equals the single-threaded one bit for bit and a
float64 numpy attention within tolerance, concurrent callers and fork() children are served."""
from __future__ import annotations

import os
import threading
import time
import warnings

import numpy as np

import kvq
from conftest import kv_data
from test_attention_options import D, QH, _cache, _ref


def _served(threads: int) -> int:
    return kvq.worker_pools().get(threads, 0)


def test_threads_run_on_a_shared_pool() -> None:
    c = _cache("kivi4,sinks=2", 700, seed=31)
    k, v = c.read(0)
    q = kv_data(3, QH, D, seed=32, outliers=False)
    one = c.attend(0, q, split_tokens=64)
    assert _served(1) == 0  # threads=1 never touches a pool
    for threads in (2, 3):
        before = _served(threads)
        out = c.attend(0, q, threads=threads, split_tokens=64)
        assert _served(threads) == before + 1
        assert np.array_equal(out, one)
    np.testing.assert_allclose(one, _ref(q, k, v)[0], rtol=1e-4, atol=2e-5)
    # attend_batch takes the same pools
    before = _served(2)
    b = kvq.attend_batch([c, c], 0, q[:2], threads=2, split_tokens=64)
    assert _served(2) == before + 1
    assert np.array_equal(b[0], c.attend(0, q[:1], split_tokens=64)[0])


def test_concurrent_callers_all_get_the_exact_result() -> None:
    c = _cache("k8v4", 900, seed=33)
    q = kv_data(2, QH, D, seed=34, outliers=False)
    want = c.attend(0, q, split_tokens=128)
    before = _served(2)
    bad: list[str] = []
    calls = 25

    def work() -> None:
        for _ in range(calls):
            out = c.attend(0, q, threads=2, split_tokens=128)
            if not np.array_equal(out, want):
                bad.append("result differs from threads=1")

    ths = [threading.Thread(target=work) for _ in range(4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert not bad
    # each call ran on the pool or, when another thread held it, on threads of its own
    assert before < _served(2) <= before + 4 * calls


def test_a_forked_child_starts_its_own_workers() -> None:
    c = _cache("kivi4,sinks=2", 600, seed=35)
    q = kv_data(2, QH, D, seed=36, outliers=False)
    want = c.attend(0, q, split_tokens=64)
    assert np.array_equal(c.attend(0, q, threads=2, split_tokens=64), want)
    assert _served(2) >= 1  # the parent's pool exists, its workers are running
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads running
        pid = os.fork()
    if pid == 0:  # child: exit code 0 when the pools start empty and the result is exact
        code = 1
        try:
            fresh = kvq.worker_pools() == {}
            out = c.attend(0, q, threads=2, split_tokens=64)
            code = 0 if fresh and np.array_equal(out, want) and _served(2) == 1 else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child's threads=2 call did not return in 60 s "
                                 "(it waited on the parent's workers)")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    # the parent's pool still serves
    assert np.array_equal(c.attend(0, q, threads=2, split_tokens=64), want)


def test_thread_count_is_checked_before_any_pool() -> None:
    c = _cache("f16", 10, seed=37)
    q = kv_data(1, QH, D, seed=38, outliers=False)
    try:
        c.attend(0, q, threads=0)
    except kvq.Error as e:
        assert "threads must be >= 1" in str(e)
    else:
        raise AssertionError("threads=0 was accepted")
    assert 0 not in kvq.worker_pools()
    # more threads than any pool keeps: std::threads, same result
    assert np.array_equal(c.attend(0, q, threads=300), c.attend(0, q))
    assert 300 not in kvq.worker_pools()


def test_pools_can_be_switched_off() -> None:
    c = _cache("k8v4", 300, seed=39)
    q = kv_data(2, QH, D, seed=40, outliers=False)
    want = c.attend(0, q)
    before = _served(2)
    assert kvq.use_worker_pools(False) is True
    try:
        assert np.array_equal(c.attend(0, q, threads=2), want)
        assert _served(2) == before  # per-call threads: the pool served nothing
        assert kvq.use_worker_pools(False) is False
    finally:
        kvq.use_worker_pools(True)
    assert np.array_equal(c.attend(0, q, threads=2), want)
    assert _served(2) == before + 1
