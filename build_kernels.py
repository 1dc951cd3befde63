#!/usr/bin/env python3
"""Compile every cula-aot kernel specialization to sm_90a cubins (no GPU needed).

    python build_kernels.py                 # default head counts into ./artifacts + ./manifest.json
    python build_kernels.py --heads 12 24   # add head counts
    python build_kernels.py --help
"""

import sys

from cula_aot.compiler.builder import main

if __name__ == "__main__":
    sys.exit(main())
