"""The guide's tooling, not imported by the chapters: the memory planner, the benchmark, the cluster's
preflight, the plot, the chapter differ, the generator of the embedded default, and the model shapes
their commands use."""
