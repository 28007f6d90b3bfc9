"""The dist backend's old module name, kept so that launch scripts written for it still run:
`python -m ftbench.dist ...` is `python -m ftbench.distributed ...` (ftbench/distributed/)."""
if __name__ == "__main__":
    import runpy

    runpy.run_module("ftbench.distributed", run_name="__main__", alter_sys=True)
