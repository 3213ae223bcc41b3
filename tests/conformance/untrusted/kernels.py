"""Misbehaving kernels, one backend each (see the package docstring). Each wraps k3ref's core of one block and
then does one bad thing; everything else is numpy64's. `HANG` waits on an event nobody sets (no sleep).

The cores that end their process or hang do so only on the golden's inputs of rmsnorm/T1-D113 (ON_GOLDEN), so
that the start-up check of an external backend's cores (fresh inputs) sees an ordinary core."""
from __future__ import annotations

import os
import signal
import sys
import threading

import numpy as np

from conformance.backends.builtin import NumpyBackend
from conformance.golden.store import COMMITTED_ROOT, read_golden
from k3ref.cores import reference_cores

_REF = reference_cores()
ON_GOLDEN = "rmsnorm/T1-D113"
_GOLDEN_X = read_golden(COMMITTED_ROOT, ON_GOLDEN).tensors["inputs.x"]


def _mxfp4_zeroing_packed(packed, scale, x):
    y = _REF.mxfp4_gemv(packed, scale, x)
    packed[...] = 0          # a kernel that reuses its input buffer as scratch
    return y


def _mla_bumping_seq_lens(q_abs, kv_cache, block_table, seq_lens, **kw):
    o = _REF.mla_decode(q_abs, kv_cache, block_table, seq_lens, **kw)
    seq_lens += 1
    return o


def _rmsnorm_scaling_x(x, w, eps):
    y = _REF.rmsnorm(x, w, eps)
    x *= 2.0
    return y


def _ending(how):
    def rmsnorm(x, w, eps):
        if not (np.shape(x) == _GOLDEN_X.shape and np.array_equal(x, _GOLDEN_X)):
            return _REF.rmsnorm(x, w, eps)
        if how == "sys.exit":
            sys.exit(0)
        if how == "os._exit":
            os._exit(0)
        if how == "SIGSEGV":
            os.kill(os.getpid(), signal.SIGSEGV)
        if how == "KeyboardInterrupt":
            raise KeyboardInterrupt
        if how == "hang":
            threading.Event().wait()
        return _REF.rmsnorm(x, w, eps)
    return rmsnorm


def _always(how):
    """A core that ends its process or hangs on every call: the start-up check meets it first."""
    def rmsnorm(x, w, eps):
        if how == "os._exit":
            os._exit(0)
        threading.Event().wait()
    return rmsnorm


def _rmsnorm_last_bit_noise(x, w, eps):
    y = np.asarray(_REF.rmsnorm(x, w, eps))
    flip = np.random.default_rng().integers(0, 2, y.shape).astype(bool)   # a fresh draw on every call
    return np.where(flip, np.nextafter(y, np.inf), y)


def _backend(name: str, deterministic: bool = True, **swaps):
    b = NumpyBackend(name, "fp64", make_cores=lambda: reference_cores().replace(**swaps))
    b.deterministic = deterministic
    return b


WRITES_FLOAT = _backend("writes-float", rmsnorm=_rmsnorm_scaling_x)
WRITES_PACKED = _backend("writes-packed", mxfp4_gemv=_mxfp4_zeroing_packed)
WRITES_SEQ_LENS = _backend("writes-seq-lens", mla_decode=_mla_bumping_seq_lens)
SYS_EXIT = _backend("sys-exit", rmsnorm=_ending("sys.exit"))
OS_EXIT = _backend("os-exit", rmsnorm=_ending("os._exit"))
SEGFAULT = _backend("segfault", rmsnorm=_ending("SIGSEGV"))
INTERRUPT = _backend("interrupt", rmsnorm=_ending("KeyboardInterrupt"))
HANG = _backend("hang", rmsnorm=_ending("hang"))
EXITS_AT_ONCE = _backend("exits-at-once", rmsnorm=_always("os._exit"))
HANGS_AT_ONCE = _backend("hangs-at-once", rmsnorm=_always("hang"))
NOISY = _backend("noisy", rmsnorm=_rmsnorm_last_bit_noise)
NOISY_DECLARED = _backend("noisy-declared", deterministic=False, rmsnorm=_rmsnorm_last_bit_noise)
