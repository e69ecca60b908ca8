"""What an exported model answers: a question through its chat template and `generate`, the answer
printed. A look after `--export-hf`, before serving it (vLLM, transformers' pipelines).

    python -m tools.ask outputs/llama-8b-capybara/hf "What is 2 + 3?"

Greedy (the same answer each time), on the GPU where one is visible, in the export's dtype.
"""

import argparse
from pathlib import Path

import torch

import common  # noqa: F401  (first: it quiets the import-time lines of torchao, which transformers imports)
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="an --export-hf folder (or any from_pretrained folder or Hub name)")
    parser.add_argument("question")
    parser.add_argument("--system", help="a system prompt before the question")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if Path(args.folder).exists() and not (Path(args.folder) / "config.json").is_file():
        raise SystemExit(f"error: {args.folder} has no config.json: pass the --export-hf folder")
    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    if not tokenizer.chat_template:
        raise SystemExit(f"error: {args.folder}'s tokenizer has no chat template: train with --chat-template FILE")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype="auto").to(device).eval()
    turns = [{"role": "system", "content": args.system}] if args.system else []
    turns.append({"role": "user", "content": args.question})
    inputs = tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    inputs = {name: value.to(device) for name, value in inputs.items()}
    output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip())


if __name__ == "__main__":
    main()
