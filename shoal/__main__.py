import sys

from shoal.serving.cli import main

sys.exit(main())
