"""The kit's benchmarks, one module per topic; run them from the repository root as modules:
``python -m benchmarks.bench_model --smoke``. The shared skeleton is :mod:`kit.bench`."""
