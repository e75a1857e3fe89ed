"""What each model actually reads: the decoded student prompt, teacher prompts and encoder input of a task.

Before a long run, look at the data: for one task of each domain this renders, decoded with the real
tokenizer, the student's initial prompt, the text-context teacher's prompt, the latent teacher's prompt
(the J·K placeholder span shown as ``[K latents × J]``) and the composer's encoder input of every retrieved
experience, with their token counts. ``lopd compare`` writes it next to its runs (``inputs.md``).
"""

from __future__ import annotations

from lopd_core.config import Config
from lopd_core.envs.base import Suite
from lopd_core.models.composer import encoder_ids, experience_turns
from lopd_core.models.latent import experiences_prompt, latent_prompt
from lopd_core.records.chat import render_prompt_ids
from lopd_core.records.experience import Bank, RetrievalQuery


def render_model_inputs(cfg: Config, tokenizer, suite: Suite, bank: Bank, *, split: str = "train",
                        per_domain: int = 1, seed: int = 0) -> str:
    """Markdown with the decoded inputs of ``per_domain`` task(s) of each domain (first token of the family)."""
    lopd = cfg.distill.lopd
    tasks, seen = [], {}
    for task in suite.tasks(split, 200, level=cfg.rollout.level, seed=seed):
        domain = task.family.split("/")[0]
        query = RetrievalQuery(instruction=task.instruction, task_id=task.task_id, exclude_same_task=True,
                               family=task.family if lopd.retrieval_family == "same" else "")
        if seen.get(domain, 0) < per_domain and bank.retriever.retrieve(query, 1):
            tasks.append((task, bank.retriever.retrieve(query, lopd.n_retrieved)))
            seen[domain] = seen.get(domain, 0) + 1
    lines = ["# What each model reads", "",
             f"Profile `{cfg.name}`; placement `{lopd.context_placement}`; J = {lopd.n_retrieved} experiences of "
             f"the task's {'own family' if lopd.retrieval_family == 'same' else 'any family'}, K = {lopd.n_latents} "
             f"latents each; experience budget {lopd.experience_max_tokens} tokens.", ""]
    for task, experiences in tasks:
        env = suite.make_env(task)
        initial = env.reset(task)
        student = render_prompt_ids(tokenizer, initial, task.tools)
        turns = [experience_turns(tokenizer, e, max_tokens=lopd.experience_max_tokens) for e in experiences]
        text = experiences_prompt(tokenizer, initial, task.tools, turns, placement=lopd.context_placement)
        latent = latent_prompt(tokenizer, initial, task.tools, n_latents=len(experiences) * lopd.n_latents,
                               placeholder_id=tokenizer.pad_token_id, placement=lopd.context_placement)
        shown = (tokenizer.decode(latent.ids[: latent.span_start]) + f"[{lopd.n_latents} latents × {len(experiences)}]"
                 + tokenizer.decode(latent.ids[latent.span_start + latent.span_length:]))
        lines += [f"## {task.family} — `{task.task_id}`", "", f"Request: {task.instruction}", "",
                  f"### Student prompt ({len(student)} tokens)", "", "```", tokenizer.decode(student), "```", "",
                  f"### Text-context teacher prompt ({len(text.ids)} tokens)", "", "```", tokenizer.decode(text.ids),
                  "```", "", f"### Latent teacher prompt ({len(latent.ids)} tokens)", "", "```", shown, "```", ""]
        for i, experience in enumerate(experiences):
            ids = encoder_ids(tokenizer, task.instruction, experience, max_tokens=lopd.experience_max_tokens)
            lines += [f"### Encoder input {i + 1}: experience `{experience.experience_id}` ({experience.family}, "
                      f"{len(ids)} tokens)", "", "```", tokenizer.decode(ids), "```", ""]
    return "\n".join(lines) + "\n"
