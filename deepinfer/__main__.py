import sys

from deepinfer.entrypoints.cli import main

sys.exit(main())
