"""Attention data parallelism + expert parallelism under torchrun: every rank runs this script.

One node, two devices:
    torchrun --nproc-per-node 2 docs/examples/torchrun_data_parallel.py --model DIR
Two nodes, one device each (run on each node, NODE_RANK 0 and 1, MASTER the first node's address):
    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 1 \\
        --master-addr $MASTER --master-port 29500 docs/examples/torchrun_data_parallel.py --model DIR

Each rank holds 1/WORLD_SIZE of the routed experts and serves its own share of the prompts (here:
every WORLD_SIZE-th one, as vLLM's torchrun example does); every rank must call generate the same
number of times. Output: one JSON line per prompt, {"index", "rank", "token_ids", "text"}.
"""

from __future__ import annotations

import argparse
import json
import os

from deepinfer import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    llm = LLM(
        args.model,
        backend=args.backend,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        data_parallel_size=world,
        enable_expert_parallel=True,
        distributed_executor_backend="external_launcher",
    )
    # the same list on every rank; each serves its share
    prompts = [[5 + (7 * i + 3 * j) % 120 for j in range(4 + 3 * i)] for i in range(5)]
    mine = [i for i in range(len(prompts)) if i % world == rank]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompts[i]} for i in mine], params, use_tqdm=False)
    for i, out in zip(mine, outputs):
        record = {
            "index": i,
            "rank": rank,
            "token_ids": out.outputs[0].token_ids,
            "text": out.outputs[0].text,
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
