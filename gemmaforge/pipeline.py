"""Stage functions: each reads its inputs from the run directory and records itself in the manifest.

`run_all` is the whole pipeline; the CLI calls these and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gemmaforge.config import RunConfig, Split
from gemmaforge.console import console
from gemmaforge.distributed import barrier, gather
from gemmaforge.errors import StageError, UserError
from gemmaforge.gguf_names import gguf_parts
from gemmaforge.model_spec import read_spec
from gemmaforge.models import ResolvedModel, resolve_model
from gemmaforge.runs import RunDir, ollama_model_name
from gemmaforge.senses import Senses


def resolve_base(config: RunConfig, home: Path) -> ResolvedModel:
    """The model a run trains on: model.name_or_path, with model.adapter merged in when given."""
    base = resolve_model(config.model.name_or_path, home, config.model.revision)
    if config.model.adapter is None:
        return base
    from gemmaforge.export.merge import adapted_base

    return adapted_base(base, config.model.adapter, home)


def base_model(run: RunDir, config: RunConfig, home: Path) -> ResolvedModel:
    base = resolve_base(config, home)
    run.update_manifest(
        base_model={"name_or_path": config.model.name_or_path, "path": str(base.path), "revision": base.revision,
                    **({"adapter": config.model.adapter} if config.model.adapter else {})},
        template_family=base.family.name,
    )
    return base


def stage_data(run: RunDir, config: RunConfig, base: ResolvedModel) -> None:
    """Clean and split the dataset; token lengths are counted with the base model's tokenizer."""
    from gemmaforge.data.prepare import prepare_data, summary_line
    from gemmaforge.models import load_tokenizer

    if run.writes:  # the main rank prepares (one per node when nodes keep their own run directory)
        with run.stage("data") as record:
            tokenizer = load_tokenizer(base.path)
            stats = prepare_data(
                config.data, config.train.seed, run.data_dir, tokenizer, base.family, config.train.cutoff_len,
                Senses.of(base.path, base.spec, tokenizer), method=config.train.method,
            )
            record.update({k: stats[k] for k in ("format", "records", "kept", "train", "val", "dropped", "changed")})
            record.update(train_sha256=stats["train_sha256"], val_sha256=stats["val_sha256"])
        console.print(f"[bold]data[/]: {summary_line(stats)} -> {run.data_dir}")
    barrier()  # the others read the main rank's files
    if run.per_node:
        check_same_data_on_every_node(run)


def check_same_data_on_every_node(run: RunDir) -> None:
    """Nodes that prepared their own copy must train on the same rows (a dataset that differs between nodes
    would silently train each rank on different examples)."""
    from gemmaforge.data.sources import file_sha256

    digests = gather(tuple(file_sha256(run.data_dir / f"{name}.jsonl") for name in ("train", "val")))
    if len(set(digests)) != 1:
        raise StageError(f"the nodes prepared different data in {run.data_dir} (train.jsonl/val.jsonl sha256 per "
                         f"rank: {digests}): give every node the same dataset file and config")


def stage_train(run: RunDir, config: RunConfig, base: ResolvedModel) -> None:
    from gemmaforge.recipe.trainer import train

    with run.stage("train") as record:
        record.update(train(run, config, base))
    console.print(f"[bold]train[/]: adapter -> {run.adapter_dir}, curve -> {run.loss_plot_path}")


def stage_eval(run: RunDir, config: RunConfig, base: ResolvedModel) -> None:
    """Base vs tuned into RUN_DIR/eval; with eval.fail_under, a failure when the tuned pass rate is below it."""
    from gemmaforge.evaluate.evaluation import evaluate
    from gemmaforge.evaluate.report import write_report

    if not run.writes:
        return
    with run.stage("eval") as record:
        results = evaluate(run, config, base)
        eval_dir = write_report(run, results)
        record.update({side: {k: results[side][k] for k in EVAL_MANIFEST_KEYS} for side in ("base", "tuned")})
        record["regressions"] = results["regressions"]
    tuned = results["tuned"]
    console.print(
        f"[bold]eval[/]: suite pass rate base {results['base']['suite_pass_rate']} -> "
        f"tuned {tuned['suite_pass_rate']}, "
        f"eval loss {results['base']['eval_loss']} -> {tuned['eval_loss']}; report -> {eval_dir / 'report.md'}"
    )
    for line in results["regressions"]:
        console.print(f"[yellow]eval: regression[/]: {line}")
    threshold = config.eval.fail_under
    if threshold is not None and tuned["suite_pass_rate"] < threshold:
        raise StageError(f"tuned suite pass rate {tuned['suite_pass_rate']} is below eval.fail_under={threshold}")


EVAL_MANIFEST_KEYS = ("eval_loss", "perplexity", "suite_pass_rate", "bleu", "rouge_l", "retention_accuracy")


def merge_adapter_folder(adapter: Path, base: ResolvedModel, target: Path) -> None:
    """A PEFT adapter folder that is not a run's (LLaMA-Factory's output_dir) merged into `target`."""
    from gemmaforge.export.merge import merge_adapter

    merge_adapter(adapter, base, target)
    console.print(f"[bold]merge[/]: {adapter} + {base.reference} -> {target}")


def stage_merge(run: RunDir, base: ResolvedModel, target: Path | None = None) -> None:
    """The adapter merged into RUN_DIR/merged, or into `target` (an LLaMA-Factory export_dir)."""
    from gemmaforge.export.merge import merge

    with run.stage("merge") as record:
        record.update(merge(run, base, target))
    console.print(f"[bold]merge[/]: {target or run.merged_dir}")


def stage_export_gguf(run: RunDir, config: RunConfig, base: ResolvedModel, quants: list[str],
                      output: Path | None = None, split: Split | None = None) -> None:
    from gemmaforge.export.gguf import write_gguf

    merged = run.require(run.merged_dir / "config.json", "merge").parent
    template = base.family.chat.jinja()
    targets = gguf_targets(quants, output, run.gguf_path)
    with run.stage("export_gguf") as record:
        files = {}
        for quant, target in targets.items():
            console.print(f"[bold]export gguf[/]: writing {target} ...")
            path = write_gguf(merged, target, quant, chat_template=template, name=ollama_model_name(config),
                              split=split or config.export.split())
            parts = gguf_parts(target)
            files[quant] = {"path": str(path), "bytes": sum(p.stat().st_size for p in parts), "shards": len(parts)}
        if base.spec.multimodal and output is None:  # the towers, for llama.cpp's --mmproj and Ollama's second FROM
            from gemmaforge.export.gguf_mmproj import write_mmproj

            console.print(f"[bold]export gguf[/]: writing {run.mmproj_path} ({', '.join(base.spec.towers)}) ...")
            path = write_mmproj(merged, run.mmproj_path, name=ollama_model_name(config))
            files["mmproj"] = {"path": str(path), "bytes": path.stat().st_size, "shards": 1}
        record["files"] = files


def stage_export_adapter(run: RunDir, base: ResolvedModel) -> None:
    """gguf/adapter-f16.gguf, and the base model as gguf/base-f16.gguf for it to apply to."""
    from gemmaforge.export.gguf import write_gguf
    from gemmaforge.export.gguf_adapter import write_adapter_gguf
    from gemmaforge.export.ollama import ADAPTER_GGUF, BASE_GGUF

    adapter = run.require(run.adapter_dir / "adapter_config.json", "train").parent
    with run.stage("export_adapter") as record:
        path = write_adapter_gguf(adapter, run.gguf_dir / ADAPTER_GGUF, base.spec)
        base_gguf = write_gguf(base.path, run.gguf_dir / BASE_GGUF, "f16", chat_template=base.family.chat.jinja())
        record.update(adapter=str(path), base=str(base_gguf))
    console.print(f"[bold]export gguf[/]: {path} on {base_gguf} (llama.cpp --lora; `export ollama --adapter` "
                  "writes a Modelfile with FROM base and ADAPTER)")


def stage_export_vllm(run: RunDir, config: RunConfig, base: ResolvedModel, adapter: bool) -> None:
    from gemmaforge.export.vllm import vllm_command, write_vllm_script

    with run.stage("export_vllm") as record:
        command = vllm_command(run, ollama_model_name(config), base_reference_for_serving(base),
                               config.export.ollama.num_ctx, adapter)
        script = write_vllm_script(run, command)
        record.update(script=str(script), adapter=adapter)
    console.print(f"[bold]export vllm[/]: {script}\n  {' '.join(command)}")


def base_reference_for_serving(base: ResolvedModel) -> str:
    """A hub id as the user gave it (vLLM downloads it); otherwise the local HF folder (for the embedded
    model and a .gguf base: the converted copy)."""
    is_hub_id = "/" in base.reference and not Path(base.reference).expanduser().exists()
    return base.reference if is_hub_id else str(base.path.resolve())


def export_checkpoint_gguf(checkpoint: Path, quants: list[str], output: Path | None, split: Split) -> None:
    """Convert a Hugging Face Gemma folder that was not trained here (its own chat template is kept)."""
    from gemmaforge.export.gguf import write_gguf

    name = checkpoint.resolve().name
    for quant, target in gguf_targets(quants, output, lambda q: checkpoint / f"{name}-{q}.gguf").items():
        console.print(f"[bold]export gguf[/]: writing {target} ...")
        path = write_gguf(checkpoint, target, quant, split=split)
        parts = gguf_parts(target)
        shards = f", {len(parts)} shards" if len(parts) > 1 else ""
        console.print(f"[bold]export gguf[/]: {path} ({sum(p.stat().st_size for p in parts) / 2**20:,.0f} MiB{shards})")
    if read_spec(checkpoint).multimodal and output is None:
        from gemmaforge.export.gguf_mmproj import write_mmproj

        path = write_mmproj(checkpoint, checkpoint / f"mmproj-{name}-f16.gguf")
        console.print(f"[bold]export gguf[/]: {path} (the towers: llama.cpp --mmproj)")


def gguf_targets(quants: list[str], output: Path | None, default: Callable[[str], Path]) -> dict[str, Path]:
    if output is not None and len(quants) != 1:
        raise UserError(f"--output names one file; give exactly one --quant (got {', '.join(quants)})")
    if output is not None and output.suffix != ".gguf":
        raise UserError(f"--output {output}: expected a file name ending in .gguf")
    return {quant: output or default(quant) for quant in dict.fromkeys(quants)}


def stage_export_verify(run: RunDir, base: ResolvedModel) -> None:
    from gemmaforge.export.verify import verify_run

    with run.stage("export_verify") as record:
        report = verify_run(run, base.family)
        record["files"] = {q: {k: r[k] for k in ("top1_agreement", "mean_kl")} for q, r in report["files"].items()}
    console.print(f"[bold]export verify[/]: {report['positions']} positions of {report['prompts']} val conversations "
                  f"-> {run.gguf_dir / 'verify.json'}")
    for quant, r in report["files"].items():
        console.print(f"  {quant:7} top-1 agreement {r['top1_agreement']:.2%}  mean KL {r['mean_kl']:.5f}  "
                      f"{r['bytes'] / 2**20:,.0f} MiB  {r['tensors']} tensors, {r['keys']} keys read back")


def stage_export_ollama(run: RunDir, config: RunConfig, base: ResolvedModel, create: bool = False,
                        adapter: bool = False) -> None:
    from gemmaforge.export.ollama import ollama_create, write_modelfile

    with run.stage("export_ollama") as record:
        modelfile = write_modelfile(run, config, base.family, adapter=adapter)
        record.update(modelfile=str(modelfile), name=ollama_model_name(config))
        if create:
            ollama_create(modelfile, ollama_model_name(config))
    console.print(f"[bold]export ollama[/]: {modelfile}  (ollama create {ollama_model_name(config)} -f {modelfile})")


def run_all(config: RunConfig, home: Path) -> RunDir:
    run = RunDir.create(config)
    base = base_model(run, config, home)
    if base.spec.multimodal and config.export.gguf:  # the projector GGUF needs the processor files: before training
        from gemmaforge.export.gguf_mmproj import processor_config

        processor_config(base.path)
    stage_data(run, config, base)
    stage_train(run, config, base)
    if config.train.method == "rm":  # a scorer: merged into a sequence classifier, nothing for llama.cpp or Ollama
        if config.eval.enabled:
            stage_eval(run, config, base)
        stage_merge(run, base)
        return run
    evaluate_gguf = config.eval.enabled and config.eval.engine == "llamacpp"
    if config.eval.enabled and not evaluate_gguf:
        stage_eval(run, config, base)
    stage_merge(run, base)
    stage_export_gguf(run, config, base, list(config.export.gguf))
    if evaluate_gguf:  # the deployed file itself: after its export
        stage_eval(run, config, base)
    stage_export_ollama(run, config, base)
    return run
