"""Names vulture cannot see used: each is reached by a string, a framework or a wire format.

``make lint`` runs vulture over the code and this file; a name listed here counts as used.
Dead code is removed, never listed: add a name only with the reason it is live.
"""

# Registered as "module:Class" strings by the built-in plugins and loaded on selection.
FlashAttnBackend
CpuPackedLinearMethod
ExternalLauncherExecutor
RayExecutor
ZmqP2PConnector
GPT2LMHeadModel
GemmaForCausalLM
MixtralForCausalLM
Phi3ForCausalLM
Qwen2MoeForCausalLM
Qwen3ForCausalLM
Qwen3MoeForCausalLM
XgrammarBackend
BertModel
PoolingModelRunner
StubModelRunner  # the executor contract's runner, by reference
NullRunner  # tests/plugins_api/test_hooks.py registers it by reference
EchoForCausalLM  # a test plugin's model, by entry point
NaiveAttentionBackend  # a test plugin's backend, by entry point
TimingExecutor  # a test plugin's executor, by entry point

# Looked up by name on a stat logger's class (enginecore.metrics.manager).
aggregate_over_engines

# Worker and engine methods called by name (collective_rpc, the utility channel).
memory_snapshot
model_summary
lora_state
trace_next_steps
get_pid
get_rank
get_supported_tasks
ping
device_assignment
call_registered_rpc  # EngineCore.collective_rpc runs registered worker RPCs through it

# Module __getattr__ (PEP 562): lazy public names of enginecore and enginecore.testing.
__getattr__

# Run by a child interpreter through `python -c` (enginecore bench throughput).
_hf_child

# Attributes read by libraries: torch's matmul precision, tokenizers' pre-tokenizer,
# ZeroMQ's CURVE socket options; pytest's collect_ignore; transformers' config field.
_.allow_tf32
_.use_cache
_.pre_tokenizer
_.curve_server
_.curve_serverkey
_.curve_publickey
_.curve_secretkey
collect_ignore

# Wire and API fields: filled here, read by clients and stat-logger plugins.
prefill_time
mean_tpot
all_stop_token_ids
num_waiting_for_remote_kvs
description  # OpenAI schema fields accepted on requests (pydantic)
guided_json
guided_regex
guided_choice
guided_grammar
truncation  # Responses API fields accepted on requests (pydantic)
service_tier
_unknown_fields  # a pydantic model validator: pydantic calls it
do_remote_decode  # zmq_p2p kv_transfer_params schema: validated, read as the dict it came as

# pytest: fixtures imported for their autouse effect, or requested for their side effect.
leak_check
alpha_beta

# ctypes structure fields set for the C library to read.
use_extra_bufts
