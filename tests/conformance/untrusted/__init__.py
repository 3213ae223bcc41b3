"""Backends that misbehave on purpose, loaded by file path (`--backend tests/.../kernels.py:NAME`) by the
isolation tests: each one is numpy64's cores with one core that writes into its input, ends its process, hangs,
or answers differently on a second call."""
