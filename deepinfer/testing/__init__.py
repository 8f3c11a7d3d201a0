"""The conformance suite and its helpers, shipped so that any backend package can run it.

    deepinfer conformance --backend NAME [pytest args]

runs `pytest -p deepinfer.testing.plugin --pyargs deepinfer.testing.conformance
--deepinfer-backend NAME`: every op of the contract is compared with the reference backend
computed in float64 on CPU copies of the same inputs (deepinfer.reference.* called on float64
tensors), for each dtype the backend claims, with the tolerances of
deepinfer.testing.tolerances.

Fixtures the plugin provides (deepinfer/testing/plugin.py), for tests added to the suite:
  backend_name        str, from --deepinfer-backend (default "reference")
  backend_registry    BackendRegistry discovered from the installed entry points (session)
  backend             the Backend under test, BackendOptions() (session)
  invariant_backend   the same backend created with batch_invariant=True; skips unless
                      capabilities.supports_batch_invariant (session)
  device              backend.device.device()
  dtype               parametrised over float32, bfloat16, float16, float64; skips the dtypes
                      the backend does not claim
  fp8                 request it to skip unless capabilities.supports_fp8
  gen                 a CPU torch.Generator seeded from the test's node id (+ --deepinfer-seed)
Markers: `heavy` (larger shapes) runs only with --deepinfer-heavy or DEEPINFER_CONFORMANCE_HEAVY=1.

Helpers: deepinfer.testing.helpers (randn, oracle, quantized_weight, make_paged_batch,
topk_indices_for, request_rows) and deepinfer.testing.tolerances (assert_close,
assert_bitwise_equal, tolerance).
"""
