"""``LLM.generate`` shows a progress bar by default, as vLLM's does; ``use_tqdm=False``
turns it off."""

from __future__ import annotations

from enginecore import LLM, SamplingParams


def test_generate_shows_a_progress_bar_unless_told_not_to(tiny_llama, capsys):
    llm = LLM(tiny_llama, max_model_len=128, num_blocks_override=64, multiprocessing=False)
    try:
        capsys.readouterr()
        params = SamplingParams(max_tokens=2, temperature=0.0)
        outputs = llm.generate(["one", "two", "three"], params)
        assert len(outputs) == 3
        err = capsys.readouterr().err
        assert "Processed prompts" in err and "3/3" in err, err
        llm.generate(["one"], params, use_tqdm=False)
        assert "Processed prompts" not in capsys.readouterr().err
    finally:
        llm.shutdown()
