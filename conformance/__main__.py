"""`python -m conformance ...` is the same CLI as `k3conf ...`."""
from .cli import main

raise SystemExit(main())
