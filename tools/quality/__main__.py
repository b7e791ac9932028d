from tools.quality.run import main

raise SystemExit(main())
