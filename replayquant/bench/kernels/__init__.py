"""`replayquant bench kernels` (GPU, not in CI): the decode kernels against their peers.

grid: the shapes, pairs and their random inputs; plan: which rows a run times and its estimated
time; rows, sweep, peers: the timed rows (our kernels, launch-config candidates, other
libraries' kernels); checks: the kernels' results against the references on the GPU; timing:
the clocks; table, render, merge: the results file, its markdown and figure, and merging runs;
run: one whole run."""
