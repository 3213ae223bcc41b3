"""Tensor parallelism over torch.distributed: every rank a process, every reduction a real collective.

    launch.py   how N ranks start: spawned by `k3conf run/decode --tp N` (env:// on a free localhost port,
                the parent watching its children) or under torchrun (RANK / WORLD_SIZE already set)
    lifetime.py ranks die with their launcher; SIGINT/SIGTERM/SIGHUP end every rank and the work directory
    measure.py  the bytes a rank read, as the kernel counts them (a rank reading past its shard fails)
    comm.py     the torch.distributed Comm a rank's K3CpuModel calls (k3ref.tp.Comm; gloo or NCCL)
    rank.py     what one rank does: build only its shard, run the k3ref host graph, rank 0 gathers
    tprun.py    the parent's side of `k3conf run --tp N`: gate rank 0's outputs against the TP 1 goldens
    mutants.py  deliberately wrong TP plans and rank-slice kernels, to show a bad split or shard is caught and named

k3ref holds the math and the plan (k3ref.tp); nothing in k3ref imports torch.
"""
