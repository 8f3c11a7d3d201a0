"""The conformance suite and its helpers, shipped so that any backend package can run it.

    deepinfer conformance --backend NAME [pytest args]

runs `pytest -p deepinfer.testing.plugin --pyargs deepinfer.testing.conformance
--deepinfer-backend NAME`: every op of the contract is compared with the reference backend
computed in float64 on CPU copies of the same inputs (deepinfer.reference.* called on float64
tensors), for each dtype the backend claims, with the tolerances of
deepinfer.testing.tolerances.

A backend that is not installed (in development, or built inside a test) is registered with
`--deepinfer-plugin MODULE[:ATTR]` (a module or object implementing the deepinfer_backends hook);
the cases that spawn processes register it there too.

Fixtures the plugin provides (deepinfer/testing/plugin.py), for tests added to the suite:
  backend_name        str, from --deepinfer-backend (default "reference")
  backend_plugins     list[str], the --deepinfer-plugin specs (session)
  backend_registry    BackendRegistry of the installed entry points plus backend_plugins (session)
  backend             the Backend under test, BackendOptions() (session)
  invariant_backend   the same backend created with batch_invariant=True; skips unless
                      capabilities.supports_batch_invariant (session)
  device              backend.device.device()
  dtype               parametrised over float32, bfloat16, float16, float64; skips the dtypes
                      the backend does not claim
  fp8                 request it to skip unless capabilities.supports_fp8
  gen                 a CPU torch.Generator seeded from the test's node id (+ --deepinfer-seed)
Markers: `heavy` (larger shapes) runs only with --deepinfer-heavy or DEEPINFER_CONFORMANCE_HEAVY=1.
Test ids containing `aligned` use production shapes (K, N multiples of 128; DeepSeek's attention
sizes), where kernels take their alignment-dependent fast paths.
The run ends with a verdict: GREEN (no failure or error, no NOT CHECKED case, only expected skips:
unclaimed capabilities, heavy cases, "not applicable: ...") or NOT GREEN with the reasons
(deepinfer.testing.plugin.verdict). Failure messages name the place (assert_close's `locate`:
request / query row / head for attention) and the case's parameters (its `case`).
A claim that cannot be checked where the suite runs (the collectives, when the backend's
torch.distributed backend is unavailable or a second device cannot be created) is skipped with
deepinfer.testing.plugin.skip_unchecked: a ConformanceGapWarning, a reason starting "NOT CHECKED"
and a section at the end of the run listing every such case.

Helpers: deepinfer.testing.helpers (randn, oracle, quantized_weight, make_paged_batch,
topk_indices_for, request_rows, attention_locator, registry_with), deepinfer.testing.tolerances
(assert_close, assert_bitwise_equal, tolerance, index_locator) and deepinfer.testing.collectives
(run_collectives: a backend's collectives across spawned processes, with a deadline).
"""
