"""`python -m nanreplay.confine JOB`: the confined child's entry (JOB: the JSON that confine.analyze wrote)."""

import json
import sys

from nanreplay.confine import child

if __name__ == "__main__":
    child.main(json.loads(sys.argv[1]))
