#!/usr/bin/env bash
# One device call (under 8 minutes) for DeepSeek-V4.1's candidate blocks and FP8 Engram rows on
# one H200:
#   1. tests: the cuda conformance cases of the indexer, both candidate-block stages and the
#      Engram lookup (float and FP8 rows, device and pinned host tables), the kernel tests of the
#      candidate blocks and the indexer (tests/test_cuda_kernels.py), and the parity tests with
#      candidate blocks (bf16 and the published KV formats) and FP8 Engram rows (reference
#      backend), in one pytest run;
#   2. kernels: the indexer at V4.1-Flash's shapes (32 heads x 128, top-1024, C1 entries), one
#      query per request at batch 1 and 64 over 65536 entries: indexer_topk, the candidate source
#      (indexer_candidate_blocks, 512 blocks of 16) and a later layer (indexer_topk_in_blocks over
#      those 8192 candidates), microseconds a call (CUDA events, 50 calls after 5 warm-up calls),
#      and the ids against the reference definition as sets (share that differ); bf16 keys, then
#      the published MXFP4 key rows (key_format "mxfp4", dequantised in registers);
#   3. end to end: `deepinfer bench --random-config deepseek-v4.1-flash --num-hidden-layers 3`
#      (FP8 + MXFP4, no Engram layer at 3 layers), and with ENGRAM4=1 the 4-layer model, whose
#      Engram layer's FP8 table (about 98 GiB with its scales) goes to pinned host memory
#      (DEEPINFER_ENGRAM_HOST_TABLES=1; the host needs that much free).
# Each part under `timeout`; logs and summary.txt in $OUT.
#   usage: OUT=dir bash bench/run_v41_candidates_h200.sh
#   knobs: TEST_TIMEOUT (200), KERNEL_TIMEOUT (120), E2E_TIMEOUT (150), ENGRAM4 (0)
. "$(dirname "$0")/h200_lib.sh"
workdir "$OUT"
pip_install > "$OUT/install.log" 2>&1
say "install rc=$? ($(torch_versions))"

# 1. tests on the GPU
part tests "${TEST_TIMEOUT:-200}" python3 -m pytest -q -rfE --tb=line -p no:cacheprovider -n 8 \
  -p deepinfer.testing.plugin --deepinfer-backend cuda --deepinfer-dtypes bfloat16,float32 \
  --pyargs deepinfer.testing.conformance tests/test_cuda_kernels.py tests/test_parity_v41.py \
  tests/test_parity_v41_quant.py tests/test_parity_v41_kv.py -k "indexer or in_blocks or engram or candidate"
grep -E "passed|failed|GREEN|RED|FAILED" "$OUT/tests.log" | tail -n 12 | tee -a "$OUT/summary.txt"

# 2. the indexer's stages at V4.1-Flash shapes
cat > "$OUT/candidates_bench.py" <<'EOF'
import torch

from deepinfer.backend import kv_formats_v41 as kvf
from deepinfer.backend.registry import get_backend
from deepinfer.backend.types import AttentionMetadata, KVCacheSpec, PagedKVCache
from deepinfer.reference import v4 as ref_v4

be, dev = get_backend("cuda"), torch.device("cuda")
gen = torch.Generator().manual_seed(0)
hi, di, topk, bs, kb, entries, page = 32, 128, 1024, 16, 512, 65536, 64


def timed(fn, n=50):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / n


def differ(a, b):
    a, b = a.sort(-1).values, b.sort(-1).values
    return float((a != b).float().mean())


for batch, fmt in ((1, None), (64, None), (1, "mxfp4"), (64, "mxfp4")):
    blocks_per = entries // page
    pool = torch.randn((batch * blocks_per, page, di), generator=gen).to(dev, torch.bfloat16)
    tables = torch.randperm(batch * blocks_per, generator=gen).view(batch, blocks_per).to(dev, torch.int32)
    keys = PagedKVCache(KVCacheSpec(pool.shape[0], page, di, 0, torch.bfloat16), (pool,))
    if fmt is not None:  # the published index-key rows; the reference reads them dequantised
        pool = kvf.quantize_rows(pool.float(), fmt)
        keys = PagedKVCache(KVCacheSpec(pool.shape[0], page, pool.shape[-1], 0, torch.uint8), (pool,))
    meta = AttentionMetadata.build(tables, [entries] * batch, [1] * batch)
    q = torch.randn((batch, hi, di), generator=gen).to(dev, torch.bfloat16)
    w = (torch.randn((batch, hi), generator=gen) * hi**-0.5).to(dev)
    args = dict(ratio=1, topk=topk, scale=di**-0.5)
    if fmt is None:
        plain = lambda: be.attention.indexer_topk(q, w, keys, meta, **args)
    else:
        plain = lambda: be.attention.quantized_indexer_topk(q, w, keys, meta, **args, key_format=fmt)
    source = lambda: be.attention.indexer_candidate_blocks(
        q, w, keys, meta, **args, block_size=bs, topk_blocks=kb, key_format=fmt
    )
    ids, blocks = source()
    later = lambda: be.attention.indexer_topk_in_blocks(q, w, keys, meta, blocks, **args, block_size=bs, key_format=fmt)
    cpu_meta = AttentionMetadata.build(tables.cpu(), [entries] * batch, [1] * batch)
    cpu_keys = PagedKVCache(keys.spec, (pool.cpu() if fmt else pool.cpu().float(),))
    read = ref_v4.read_kv if fmt is None else (lambda c, s: kvf.dequantize_rows(ref_v4.read_kv(c, s), fmt))
    want_ids, want_blocks = ref_v4.indexer_candidate_blocks(
        q.cpu().float(), w.cpu(), cpu_keys, cpu_meta, 1, topk, di**-0.5, bs, kb, read
    )
    want_later = ref_v4.indexer_topk_in_blocks(
        q.cpu().float(), w.cpu(), cpu_keys, cpu_meta, want_blocks, 1, topk, di**-0.5, bs, read
    )
    print(
        f"batch {batch:3d}, {fmt or 'bf16'} keys, {entries} entries: indexer_topk {timed(plain):8.1f} us | "
        f"indexer_candidate_blocks {timed(source):8.1f} us | indexer_topk_in_blocks {timed(later):8.1f} us | "
        f"differ from the reference: ids {differ(ids.cpu(), want_ids):.4f}, blocks "
        f"{differ(blocks.cpu(), want_blocks):.4f}, later {differ(later().cpu(), want_later):.4f}"
    )
EOF
part kernels "${KERNEL_TIMEOUT:-120}" python3 "$OUT/candidates_bench.py"
grep -E "^batch|Error" "$OUT/kernels.log" | tee -a "$OUT/summary.txt"

# 3. end to end: the reduced-depth published-format model
part e2e3 "${E2E_TIMEOUT:-150}" python3 -m deepinfer bench --random-config deepseek-v4.1-flash \
  --num-hidden-layers 3 --quantization fp8 --backend cuda --num-prompts 64 --random-input-len 128 \
  --random-output-len 64
grep -E "Throughput|tok/s|Total num|random|Error" "$OUT/e2e3.log" | cut -c1-200 | tee -a "$OUT/summary.txt"
if [ "${ENGRAM4:-0}" = 1 ]; then
  DEEPINFER_ENGRAM_HOST_TABLES=1 part e2e4 "${E2E_TIMEOUT:-150}" python3 -m deepinfer bench \
    --random-config deepseek-v4.1-flash --num-hidden-layers 4 --quantization fp8 --backend cuda \
    --num-prompts 8 --random-input-len 128 --random-output-len 32
  grep -E "Throughput|tok/s|Total num|random|Error" "$OUT/e2e4.log" | cut -c1-200 | tee -a "$OUT/summary.txt"
fi
say "total ${SECONDS} s"
