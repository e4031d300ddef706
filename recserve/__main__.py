import sys

from recserve.cli.main import main

sys.exit(main())
