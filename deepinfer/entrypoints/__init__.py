"""What starts deepinfer, above the engine: the command line (cli.py; generate.py, bench.py and
run_batch.py, with the options they share in options.py) and the data-parallel executor
(data_parallel.py), which `LLM(data_parallel_size=N)` runs: above the engine, below the offline
API (tests/test_import_layers.py keeps the layers)."""
