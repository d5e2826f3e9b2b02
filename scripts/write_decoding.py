"""Write the decoding knobs of a JSON file (scripts/sudoku-decoding.json) into a model's generation_config.json,
as save_pretrained writes them, and print them as `dgemma sudoku eval` flags.

    python scripts/write_decoding.py MODEL/generation_config.json scripts/sudoku-decoding.json
"""

import json
import sys
from pathlib import Path

from dgemma.config import SamplingConfig

path, chosen = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
gen = json.loads(path.read_text())
knobs = {key: chosen[key] for key in ("t_max", "t_min", "max_denoising_steps", "entropy_bound")}
gen.update(SamplingConfig.from_hf_dict(gen).replace(**knobs).to_hf_dict())
path.write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
print(f"--t-max {knobs['t_max']} --t-min {knobs['t_min']} --steps {knobs['max_denoising_steps']} "
      f"--entropy-bound {knobs['entropy_bound']}")
