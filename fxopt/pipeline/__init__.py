"""Pipeline: the pass manager, default pipelines, instruments, verification and the report."""
