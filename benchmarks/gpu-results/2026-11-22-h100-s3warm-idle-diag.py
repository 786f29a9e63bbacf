import time, numpy as np, flashport
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((1, 8, 4096, 64), dtype=np.float32) for _ in range(4))
for causal in (False, True, True, False):
    ts = []
    for _ in range(4):
        t0 = time.perf_counter(); o, l = flashport.attention(q, k, v, causal=causal, return_lse=True, device="gpu"); t1 = time.perf_counter()
        kern = sum(t for n, t in flashport._core._gpu_kernel_times() if not n.startswith("host:"))
        flashport.attention_backward(do, q, k, v, o, l, causal=causal, device="gpu")
        ts.append((round((t1 - t0) * 1e3, 1), round(kern * 1e3, 2)))
    print("causal", causal, "fwd (e2e ms, kernel ms):", ts, flush=True)
    time.sleep(1.0)
