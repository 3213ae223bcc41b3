"""`python -m conformance ...` is the same CLI as `k3conf ...`."""
from conformance.cli import main

raise SystemExit(main())
