"""The product's command lines (build_repository, render_templates, fill_template,
launch_triton_server, serve, prepare_model, client, perf_analyzer_env) and what they, the tests,
bench/ and checks/ share: triton_probe and recovery (the launcher's), local_server (a real
tritonserver on free loopback ports), checkpoints (tiny random Hugging Face models), null_worker
(an engine whose model does nothing) and soak_run (perf_analyzer load against a server).

Each command line runs as `python tools/<name>.py ...` or `python -m tools.<name> ...`; modules
here import each other as `tools.<name>` (the editable install, or the repository root on the
path, provides the package).
"""
