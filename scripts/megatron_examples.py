#!/usr/bin/env python3
# Megatron-LM's example launch scripts (examples/{gpt3,llama,mixtral,gptoss,mamba}) as a user runs them,
# shrunk to a CPU-sized model and run through build/bin/pretrain_gpt.
#
#   python3 scripts/megatron_examples.py extract <Megatron-LM checkout> [out dir]
#       runs each script under bash with `torchrun` and `python` replaced by functions that record their
#       argv (so the scripts' own variables, defaults, arrays and word splitting are what a user gets),
#       keeps what follows pretrain_gpt.py / pretrain_hybrid.py, and writes <name>.args (verbatim, one
#       argument a line) and <name>.shrunk.args (the CPU-sized run) to the out dir
#       (default tests/fixtures/megatron_examples).
#   python3 scripts/megatron_examples.py run [fixture dir] [pretrain_gpt binary]
#       runs every <name>.shrunk.args in a scratch directory and prints one table row per script.
#
# Shrinking changes only sizes (SIZES below), the parallel sizes (to 1), the data (mock data with
# NullTokenizer, where a script reads files), and adds --device cpu; every other flag stays as given.
import os, re, subprocess, sys, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name: (script relative to examples/, its positional arguments)
SCRIPTS = {
    'gpt3': ('gpt3/train_gpt3_175b_distributed.sh',
             ['checkpoints', 'tensorboard', 'gpt2-vocab.json', 'gpt2-merges.txt', 'my-gpt3_00_text_document']),
    'llama': ('llama/train_llama3_8b_h100_fp8.sh', []),  # its defaults: MOCK tokenizer and data
    'mixtral': ('mixtral/train_mixtral_8x7b_distributed.sh', ['checkpoints', 'tokenizer.model', 'my-mixtral_text_document']),
    'gptoss': ('gptoss/02_train.sh', ['--checkpoint-path', 'checkpoints']),  # its defaults: MOCK tokenizer and data
    'mamba': ('mamba/train.sh', ['my-mamba_text_document', 'tokenizer.model']),
}
TRAIN_SCRIPTS = ('pretrain_gpt.py', 'pretrain_hybrid.py')

# flag: shrunk value. --train-samples is 3 iterations of the shrunk global batch.
SIZES = {
    '--num-layers': '2', '--hidden-size': '64', '--ffn-hidden-size': '128', '--moe-ffn-hidden-size': '64',
    '--num-attention-heads': '4', '--num-query-groups': '2', '--kv-channels': '16', '--seq-length': '64',
    '--max-position-embeddings': '64', '--num-experts': '4', '--vocab-size': '1024',
    '--micro-batch-size': '2', '--global-batch-size': '4', '--train-iters': '3', '--train-samples': '12',
    '--log-interval': '1',
    '--tensor-model-parallel-size': '1', '--pipeline-model-parallel-size': '1',
    '--expert-model-parallel-size': '1', '--context-parallel-size': '1',
}
# Read files a user supplies; replaced by --mock-data --tokenizer-type NullTokenizer --vocab-size 1024.
DATA_FILES = {'--data-path', '--vocab-file', '--merge-file', '--tokenizer-model', '--tokenizer-type'}

FAKE = r'''
record() { printf '%s\0' "$@" >> "$ARGS_OUT"; }
torchrun() { record "$@"; }
python() { record "$@"; }
export -f record torchrun python
'''


def extract(ref: Path, name: str) -> list:
    script, positional = SCRIPTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / 'pretrain_gpt.py').touch()  # the scripts check that it is there
        (tmp / 'checkpoints').mkdir()  # gptoss checks that its --checkpoint-path exists
        out = tmp / 'argv'
        env = dict(os.environ, ARGS_OUT=str(out), PWD=str(tmp))
        subprocess.run(['bash', '-c', FAKE + 'bash "$@"', 'bash', str(ref / 'examples' / script), *positional],
                       cwd=tmp, env=env, check=True, stdout=subprocess.DEVNULL)
        argv = out.read_bytes().decode().split('\0')[:-1]
        # The scripts' data caches are under $PWD; make them relative to where the run happens.
        argv = [a.replace(str(tmp) + '/', '') for a in argv]
    at = next(i for i, a in enumerate(argv) if a.endswith(TRAIN_SCRIPTS))
    return argv[at:]  # the training script, then its arguments


def shrink(args: list) -> list:
    out, i = [], 0
    mock = '--mock-data' in args
    while i < len(args):
        a = args[i]
        if a in SIZES:
            out += [a, SIZES[a]]
            i += 2
        elif a in DATA_FILES and not mock:
            i += 2
        else:
            out.append(a)
            i += 1
    if not mock:
        out += ['--mock-data', '--tokenizer-type', 'NullTokenizer']
    if '--vocab-size' not in out:
        out += ['--vocab-size', SIZES['--vocab-size']]
    return out + ['--device', 'cpu']


def write_lines(path: Path, lines: list):
    path.write_text(''.join(l + '\n' for l in lines))


def run(fixtures: Path, binary: Path):
    print('| script | result | output |')
    print('|---|---|---|')
    for f in sorted(fixtures.glob('*.shrunk.args')):
        name = f.name[:-len('.shrunk.args')]
        args = f.read_text().splitlines()
        with tempfile.TemporaryDirectory() as tmp:
            p = subprocess.run([str(binary), *args], cwd=tmp, capture_output=True, text=True, timeout=600)
        text = p.stdout + p.stderr
        losses = re.findall(r'\| lm loss: +([^ |]+) \|', text)
        if p.returncode == 0 and losses:
            print(f'| {name} | runs | lm loss {" ".join(losses)} |')
        else:
            lines = [l for l in text.splitlines() if l.strip()]
            print(f'| {name} | exit {p.returncode} | {" / ".join(lines[-3:])} |')


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == 'extract':
        ref = Path(sys.argv[2])
        out = Path(sys.argv[3]) if len(sys.argv) > 3 else ROOT / 'tests/fixtures/megatron_examples'
        out.mkdir(parents=True, exist_ok=True)
        for name in SCRIPTS:
            argv = extract(ref, name)
            write_lines(out / f'{name}.args', argv)
            write_lines(out / f'{name}.shrunk.args', shrink(argv[1:]))
    elif len(sys.argv) >= 2 and sys.argv[1] == 'run':
        fixtures = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / 'tests/fixtures/megatron_examples'
        binary = Path(sys.argv[3]) if len(sys.argv) > 3 else ROOT / 'build/bin/pretrain_gpt'
        run(fixtures, binary)
    else:
        sys.exit(__doc__ if __doc__ else 'usage: megatron_examples.py extract <Megatron-LM> [out] | run [dir] [binary]')


if __name__ == '__main__':
    main()
