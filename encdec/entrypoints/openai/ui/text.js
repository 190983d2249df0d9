// "Text": translate (the tokenizer's language codes in the pickers), summarize or
// generate with the loaded text model through /v1/completions, streamed unless
// beam search is asked for (beams are not streamed).
import { postJSON, showError, sseEvents } from "./api.js";

function option(select, value, label = value) {
  const o = document.createElement("option");
  o.value = value;
  o.textContent = label;
  select.append(o);
}

function pick(select, preferred) {
  for (const code of preferred) {
    if ([...select.options].some((o) => o.value === code)) { select.value = code; return; }
  }
}

function initLanguages(translation) {
  const $ = (id) => document.getElementById(id);
  const src = $("tx-src"), tgt = $("tx-tgt");
  if (!translation.source.length) {  // Marian: one fixed source language
    src.disabled = true;
    option(src, "", "the model's");
  }
  translation.source.forEach((c) => option(src, c));
  translation.target.forEach((c) => option(tgt, c));
  pick(src, ["eng_Latn", "en", "en_XX"]);
  pick(tgt, ["deu_Latn", "de", "de_DE", "fra_Latn", "fr"]);
}

async function request(status, task, text) {
  const $ = (id) => document.getElementById(id);
  const body = { model: status.model, max_tokens: Number($("tx-max").value), temperature: Number($("tx-temperature").value),
    top_p: Number($("tx-top-p").value) };
  if (task === "translate") {
    const ids = await (await postJSON("/ui/translation-prompt",
      { text, src_lang: $("tx-src").value || null, tgt_lang: $("tx-tgt").value || null })).json();
    body.prompt = ids.prompt;
    if (ids.decoder_prompt) body.decoder_prompt = ids.decoder_prompt;
    if (ids.forced_bos_token_id !== null) body.vllm_xargs = { forced_bos_token_id: ids.forced_bos_token_id };
  } else {
    body.prompt = text;
  }
  const beams = Number($("tx-beams").value);
  if (beams > 1) {
    Object.assign(body, { use_beam_search: true, n: 1, best_of: beams });
    delete body.top_p;
    delete body.vllm_xargs;
  } else {
    body.stream = true;
  }
  return body;
}

export function initText(status) {
  const $ = (id) => document.getElementById(id);
  const task = $("tx-task"), output = $("tx-output"), error = $("tx-error"), run = $("tx-run"), stop = $("tx-stop");
  if (status.translation) {
    option(task, "translate", "Translate");
    initLanguages(status.translation);
  }
  option(task, "generate", status.translation ? "Generate (the text as the encoder's input)" : "Summarize / generate");
  const showLanguages = () => { $("tx-langs").hidden = task.value !== "translate"; };
  task.addEventListener("change", showLanguages);
  showLanguages();
  let controller = null;

  $("tx-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    showError(error, null);
    output.textContent = "";
    output.dataset.chunks = "0";
    output.dataset.state = "running";
    run.disabled = true;
    stop.disabled = false;
    controller = new AbortController();
    try {
      const body = await request(status, task.value, $("tx-input").value);
      const response = await postJSON("/v1/completions", body, { signal: controller.signal });
      if (body.stream) {
        for await (const event of sseEvents(response)) {
          const choice = event.choices && event.choices[0];
          if (!choice) continue;
          output.textContent += choice.text;
          output.dataset.chunks = String(Number(output.dataset.chunks) + 1);
        }
      } else {
        output.textContent = (await response.json()).choices[0].text;
        output.dataset.chunks = "1";
      }
      output.dataset.state = "done";
    } catch (err) {
      output.dataset.state = "error";
      if (err.name !== "AbortError") showError(error, err);
    } finally {
      run.disabled = false;
      stop.disabled = true;
      controller = null;
    }
  });
  stop.addEventListener("click", () => controller && controller.abort());
}
