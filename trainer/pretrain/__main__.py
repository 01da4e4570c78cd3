"""`python -m trainer.pretrain`: the same as `tabloop pretrain`."""

import sys

from trainer.pretrain.run import main

sys.exit(main())
