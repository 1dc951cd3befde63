#!/usr/bin/env python3
"""Compile every cula-aot kernel specialization to sm_90a cubins (no GPU needed).

python build_kernels.py                 # every kernel (each serves any head count) into ./artifacts + ./manifest.json
python build_kernels.py --out DIR       # elsewhere (point CULA_AOT_ARTIFACTS at DIR)
python build_kernels.py --help
"""

import sys

from cula_aot.compiler.builder import main

if __name__ == "__main__":
    sys.exit(main())
