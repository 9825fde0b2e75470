"""Print an installed distribution's own requirements (markers evaluated, no extras), with stand-ins.

    python wheel_requirements.py vllm flashinfer-python==0.7.4

prints every requirement of the installed ``vllm`` for this interpreter, with any requirement on
``flashinfer-python`` replaced by ``flashinfer-python==0.7.4``: how `make test-vllm` installs a
release whose pin the package registry lacks, after `pip install --no-deps` of the release itself.
"""

import sys
from importlib.metadata import requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def main(dist: str, *standins: str) -> None:
    replace = {canonicalize_name(Requirement(s).name): s for s in standins}
    for line in requires(dist) or ():
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        print(replace.get(canonicalize_name(req.name), str(req).split(";")[0].strip()))


if __name__ == "__main__":
    main(*sys.argv[1:])
