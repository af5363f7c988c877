"""`python -m graphpersist` runs the same CLI as the `graphpersist` console script."""

from graphpersist.cli import main

raise SystemExit(main())
