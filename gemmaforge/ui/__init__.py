"""`gemmaforge ui`: a web dashboard over run directories (Gradio, mounted on FastAPI).

The run directory is its only state: overview.py reads runs as the stages leave them (the manifest, metrics.jsonl,
eval/results.json, gguf/verify.json), app.py lays them out in the browser. Nothing here trains or converts.
"""
