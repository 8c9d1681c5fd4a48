from idemproxy.cli import main

raise SystemExit(main())
