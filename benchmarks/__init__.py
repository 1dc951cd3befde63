"""The benchmark and profiling scripts, run as modules from the repository root
(``python3 -m benchmarks.bench_prefill ...``): the checkout's ``cula_aot`` and these modules are
then found from the working directory, with nothing installed."""
