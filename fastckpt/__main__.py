"""``python -m fastckpt``: the same command line as the ``fastckpt`` console script.

Example (shell)::

    $ python -m fastckpt verify model.safetensors
"""

import sys

from fastckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
