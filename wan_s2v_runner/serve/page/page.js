// wan-s2v status page: reads the server's API like any client (see page/__init__.py).
"use strict";

const TOKEN_KEY = "wan-s2v-token";
const $ = (sel, root = document) => root.querySelector(sel);
const videoUrls = new Map(); // job id -> object URL of its fetched mp4
let fields = [];
const AUTO_LOAD_VIDEOS = 3;

// ----- the API, with the token (kept for this browser session) -----
function headers() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { Authorization: `Bearer ${token}` } : {};
}

class Unauthorized extends Error {}

// an error response's one line: the API's {"error": {"message"}}, else its text
async function errorMessage(r) {
  const text = await r.text();
  try {
    return JSON.parse(text).error.message;
  } catch {
    return `${r.status} ${r.statusText}: ${text.slice(0, 200)}`;
  }
}

async function api(path, options = {}) {
  const r = await fetch(path, { ...options, headers: { ...headers(), ...(options.headers || {}) } });
  if (r.status === 401) throw new Unauthorized(await errorMessage(r));
  return r;
}

// one question at a time: every caller that met a 401 waits for the same answer
let tokenAsked = null;
function askToken(message) {
  const dialog = $("#token-dialog");
  $("#token-error").textContent = message || "";
  if (!dialog.open) dialog.showModal();
  if (!tokenAsked) {
    tokenAsked = new Promise((resolve) => {
      $("#token-form").onsubmit = () => {
        sessionStorage.setItem(TOKEN_KEY, $("#token-input").value);
        tokenAsked = null;
        resolve();
      };
      dialog.oncancel = (e) => e.preventDefault(); // Escape: the page cannot work without it
    });
  }
  return tokenAsked;
}

async function withToken(fn) {
  for (;;) {
    try {
      return await fn();
    } catch (e) {
      if (!(e instanceof Unauthorized)) throw e;
      const hadToken = Boolean(headers().Authorization); // a wrong one: say why
      sessionStorage.removeItem(TOKEN_KEY);
      await askToken(hadToken ? e.message : "");
    }
  }
}

// ----- formatting -----
const fmtS = (s) => {
  if (s === null || s === undefined) return "-";
  s = Math.max(0, Math.round(s));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
  return (h ? `${h}:${String(m).padStart(2, "0")}` : `${m}`) + `:${String(r).padStart(2, "0")}`;
};
const fmtMb = (mb) => (mb === null || mb === undefined ? "-" : mb >= 1024 ? `${(mb / 1024).toFixed(1)} GB` : `${Math.round(mb)} MB`);

// ----- the server -----
let uptimeFrom = null;
setInterval(() => {
  const el = $("#uptime");
  if (el && uptimeFrom) el.textContent = fmtS(uptimeFrom.s + (Date.now() - uptimeFrom.at) / 1000);
}, 1000);
function renderServer(s) {
  $("#model").textContent = s.model;
  const badge = $("#group-state");
  badge.textContent = s.group;
  badge.className = `badge ${s.group}`;
  const L = s.layout;
  const rows = [
    ["mode", `${L.mode}: CFG ${L.cfg_degree} x SP ${L.sp_degree}${L.vae_parallel ? ", split VAE" : ""}`],
    ["ranks", `${L.world_size} (${L.nnodes} node${L.nnodes > 1 ? "s" : ""} x ${L.nproc}) on ${L.device}`],
    ["attention", L.attention],
    ["LoRAs", s.loras.length ? s.loras.join(", ") : "none"],
    ["uptime", fmtS(s.uptime_s)],
    ["rank groups", `${s.groups} started, ${s.restarts} restart${s.restarts === 1 ? "" : "s"}`],
  ];
  const Q = s.queue_state; // the queue and the shared directory, as the server's watch last saw them
  if (Q) {
    const down = Q.up ? "" : `: unavailable since ${new Date(Q.down_since * 1000).toLocaleTimeString()} (${Q.error})`;
    rows.push(["queue", `${Q.shared ? "shared" : "this server's"}, pool ${Q.pool}${down}`]);
    if (Q.shared_dir_problem) rows.push(["shared directory", Q.shared_dir_problem]);
  }
  if ((s.replicas || []).length > 1) { // --replicas: each group, what it holds and what it does
    for (const r of s.replicas) {
      rows.push([`group ${r.index}`, `${r.holds}: ${r.group}${r.current ? ` (${r.current})` : ""}` +
                 (r.restarts ? `, ${r.restarts} restart${r.restarts === 1 ? "" : "s"}` : "")]);
    }
  }
  $("#layout").replaceChildren(...rows.flatMap(([k, v]) => {
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = k; dd.textContent = v;
    if (k === "uptime") dd.id = "uptime";
    return [dt, dd];
  }));
  uptimeFrom = { s: s.uptime_s, at: Date.now() }; // the feed sends the server only when it changed
  $("#ranks tbody").replaceChildren(...s.ranks.map((r) => {
    const tr = document.createElement("tr");
    const rank = (s.replicas || []).length > 1 ? `${r.group}:${r.rank}` : r.rank; // group:rank with replicas
    for (const v of [rank, r.host || "-", r.stage, fmtMb(r.rss_mb), fmtMb(r.host_peak_rss_mb), fmtMb(r.gpu_peak_allocated_mb)]) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.append(td);
    }
    return tr;
  }));
  $("#last-error").textContent = s.last_error ? `last group error: ${s.last_error}` : "";
  const q = s.queue;
  $("#counts").textContent = `${q.queued} queued, ${q.in_progress} running, ${q.completed} completed, ${q.failed} failed, ${q.cancelled} cancelled`;
}

// ----- the jobs -----
function detailOf(v) {
  if (v.status === "queued") return `queued, position ${v.queue_position ?? "?"}`;
  if (v.status === "in_progress") {
    // the position in the job's own unit: a clip job's clip and step, a live job's block (no steps)
    const where = v.unit === "block"
      ? (v.block !== null && v.block !== undefined ? ` · block ${v.block}/${v.blocks ?? "?"}` : "")
      : (v.step !== null && v.step !== undefined ? ` · clip ${v.clip ?? "?"}/${v.clips ?? "?"} · step ${v.step}/${v.steps ?? "?"}` : "");
    const elapsed = v.started_at ? ` · ${fmtS(Date.now() / 1000 - v.started_at)} elapsed` : "";
    return `${v.stage || "starting"}${where} · ${v.progress}%${elapsed} · ETA ${fmtS(v.eta_s)}`;
  }
  if (v.status === "completed") return `done in ${fmtS(v.wall_s)}${v.resumed_at_clip ? `, resumed at clip ${v.resumed_at_clip}` : ""}`;
  return v.status;
}

async function showVideo(v, box) {
  if (box.dataset.loaded) return; // loading, loaded, or failed (then a retry button is there)
  box.dataset.loaded = "1";
  try {
    let url = videoUrls.get(v.id);
    if (!url) {
      const r = await api(`/v1/videos/${v.id}/content`);
      if (!r.ok) throw new Error(await errorMessage(r));
      url = URL.createObjectURL(await r.blob());
      videoUrls.set(v.id, url);
    }
    const video = document.createElement("video");
    video.controls = true;
    video.preload = "metadata";
    video.src = url;
    const link = document.createElement("a");
    link.href = url;
    link.download = `${v.id}.mp4`;
    link.className = "download";
    link.textContent = `Download ${v.id}.mp4`;
    box.replaceChildren(video, link);
  } catch (e) {
    const retry = document.createElement("button");
    retry.type = "button";
    retry.textContent = "Retry";
    retry.onclick = () => { delete box.dataset.loaded; showVideo(v, box); };
    const why = document.createElement("span");
    why.className = "error";
    why.textContent = `could not load the video: ${e.message} `;
    box.replaceChildren(why, retry);
  }
}

// the video so far: fetched again each time it grows (preview_clips), kept after a cancel
async function showPartial(v, box) {
  const clips = v.preview_clips || 0;
  if (!clips || box.dataset.clips === String(clips) || box.dataset.loading) return;
  box.dataset.loading = "1";
  try {
    const r = await api(`/v1/videos/${v.id}/content?variant=partial`);
    if (!r.ok) throw new Error(await errorMessage(r));
    const url = URL.createObjectURL(await r.blob());
    const old = $("video", box);
    const video = old || document.createElement("video");
    if (video.src) URL.revokeObjectURL(video.src);
    video.controls = true;
    video.muted = true;
    video.preload = "metadata";
    video.src = url;
    const note = document.createElement("span");
    note.className = "muted partial-note";
    const ended = v.status === "cancelled" || v.status === "failed";
    const [of, unit] = v.unit === "block" ? [v.blocks, "blocks"] : [v.clips, "clips"];
    note.textContent = `video so far: ${clips} of ${of ?? "?"} ${unit}${ended ? ` (the job was ${v.status})` : ""}`;
    box.replaceChildren(note, video);
    box.dataset.clips = String(clips);
  } catch (e) {
    box.textContent = `the video so far could not be loaded: ${e.message}`;
  } finally {
    delete box.dataset.loading;
  }
}

// the jobs the feed holds (a row no longer among them goes)
function renderJobs(videos) {
  const list = $("#jobs");
  const seen = new Set();
  // the newest finished videos load by themselves; older ones on a click (each is a whole mp4)
  const autoLoad = new Set(videos.filter((v) => v.status === "completed")
    .sort((a, b) => b.created_at - a.created_at).slice(0, AUTO_LOAD_VIDEOS).map((v) => v.id));
  for (const v of [...videos].sort((a, b) => a.created_at - b.created_at)) { // the newest ends on top
    seen.add(v.id);
    let el = list.querySelector(`[data-id="${v.id}"]`);
    if (!el) {
      el = $("#job-template").content.firstElementChild.cloneNode(true);
      el.dataset.id = v.id;
      $(".job-id", el).textContent = v.id;
      $(".cancel", el).onclick = () => cancel(v.id);
      list.prepend(el);
    }
    el.dataset.status = v.status;
    $(".status", el).textContent = v.status + (v.cancel_requested && v.status === "in_progress" ? " (cancelling)" : "");
    $(".status", el).className = `badge status ${v.status}`;
    $(".prompt", el).textContent = v.prompt || "";
    $(".prompt", el).title = v.prompt || "";
    $(".progress-bar", el).value = v.progress;
    $(".detail", el).textContent = `${detailOf(v)} · seed ${v.seed ?? "-"}`;
    const stages = v.stage_seconds ? Object.entries(v.stage_seconds).map(([k, s]) => `${k} ${s.toFixed(1)}s`).join(" · ") : "";
    $(".stages", el).textContent = stages;
    $(".job-error", el).textContent = v.error && v.status === "failed" ? v.error.message : "";
    $(".cancel", el).hidden = !(v.status === "queued" || v.status === "in_progress") || v.cancel_requested;
    const partial = $(".partial", el);
    if (v.status === "completed" || v.status === "queued") {
      if (partial.firstChild) {
        const old = $("video", partial);
        if (old && old.src) URL.revokeObjectURL(old.src);
        partial.replaceChildren();
        delete partial.dataset.clips;
      }
    } else if (v.preview_clips) {
      showPartial(v, partial);
    }
    if (v.status === "completed") {
      const box = $(".result", el);
      if (autoLoad.has(v.id)) showVideo(v, box);
      else if (!box.dataset.loaded && !box.firstChild) {
        const b = document.createElement("button");
        b.type = "button";
        b.className = "show-video";
        b.textContent = "Show video";
        b.onclick = () => showVideo(v, box);
        box.append(b);
      }
    }
  }
  for (const el of [...list.children]) {
    if (seen.has(el.dataset.id)) continue;
    if (videoUrls.has(el.dataset.id)) URL.revokeObjectURL(videoUrls.get(el.dataset.id));
    videoUrls.delete(el.dataset.id);
    el.remove();
  }
}

async function cancel(id) {
  await withToken(async () => {
    const r = await api(`/v1/videos/${id}/cancel`, { method: "POST" });
    if (!r.ok) alert(await errorMessage(r));
  });
}

// ----- the live feed: server-sent events read with fetch (the token goes in a header) -----
// "snapshot" (on connecting): the server and the newest jobs; "changes": only what changed
const known = new Map(); // job id -> its video object, as the feed last sent it
function applyFeed(event, data) {
  if (event === "snapshot") known.clear();
  else if (event !== "changes") return; // "error": the stream ends, and follow() reconnects
  for (const id of data.gone || []) known.delete(id);
  for (const v of data.videos || []) known.set(v.id, v);
  if (data.server) renderServer(data.server);
  renderJobs([...known.values()]);
}
async function follow() {
  for (;;) {
    let reader = null;
    try {
      const r = await api("/v1/events", { headers: { Accept: "text/event-stream" } });
      if (!r.ok) throw new Error(await errorMessage(r));
      $("#feed").textContent = "live";
      reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const lines = block.split("\n");
          const event = (lines.find((l) => l.startsWith("event:")) || "event: message").slice(6).trim();
          const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
          if (data) applyFeed(event, JSON.parse(data));
        }
      }
    } catch (e) {
      if (e instanceof Unauthorized) {
        sessionStorage.removeItem(TOKEN_KEY);
        await askToken(e.message);
        continue;
      }
      console.error("wan-s2v feed:", e);
    } finally {
      if (reader) reader.cancel().catch(() => {}); // close this stream before opening the next
    }
    $("#feed").textContent = "reconnecting…";
    await new Promise((ok) => setTimeout(ok, 1000));
  }
}

// ----- the submit form, built from the server's job fields -----
// where each field goes: the prompts first after the inputs, the text-to-speech fields under the
// voice upload, the sampling settings after them
const PROMPT_FIELDS = ["prompt", "negative_prompt"];
const TTS_FIELDS = ["tts_text", "tts_prompt_text"];
function fieldBox(name) {
  if (PROMPT_FIELDS.includes(name)) return $("#prompt-fields");
  if (TTS_FIELDS.includes(name)) return $("#tts-fields");
  return $("#fields");
}

function buildForm(list, maxUploadMb) {
  fields = list;
  for (const box of [$("#prompt-fields"), $("#tts-fields"), $("#fields")]) box.replaceChildren();
  const order = (f) => (PROMPT_FIELDS.includes(f.name) ? PROMPT_FIELDS.indexOf(f.name) - 10 : 0);
  for (const f of [...list].sort((a, b) => order(a) - order(b))) {
    const box = fieldBox(f.name);
    const label = document.createElement("label");
    label.textContent = f.label || f.name;
    let input;
    if (f.enum) {
      input = document.createElement("select");
      for (const choice of ["", ...f.enum]) {
        const o = document.createElement("option");
        o.value = choice;
        o.textContent = choice === "" ? `default (${f.default ?? "none"})` : choice;
        input.append(o);
      }
    } else if (f.type === "boolean") {
      input = document.createElement("select");
      for (const [v, t] of [["", `default (${f.default ?? false})`], ["true", "yes"], ["false", "no"]]) {
        const o = document.createElement("option");
        o.value = v; o.textContent = t;
        input.append(o);
      }
    } else if (f.name.includes("prompt") || f.name === "tts_text") {
      input = document.createElement("textarea");
      input.rows = 2;
      label.className = "wide";
    } else {
      input = document.createElement("input");
      input.type = f.type === "integer" || f.type === "number" ? "number" : "text";
      if (f.type === "number") input.step = "any";
      if (f.minimum !== null && f.minimum !== undefined) input.min = f.minimum;
      if (f.maximum !== null && f.maximum !== undefined) input.max = f.maximum;
    }
    input.name = f.name;
    if (!f.enum && f.type !== "boolean" && f.default !== null && f.default !== undefined) input.placeholder = String(f.default);
    const hint = document.createElement("span");
    hint.className = "hint";
    hint.textContent = f.flag ? `${f.flag}: ${f.description}` : f.description;
    const err = document.createElement("span");
    err.className = "error";
    err.dataset.errorFor = f.name;
    label.append(input, hint, err);
    box.append(label);
  }
  $("#submit-form").dataset.maxUploadMb = maxUploadMb;
}

function preview(input, el) {
  input.onchange = () => {
    if (el.src.startsWith("blob:")) URL.revokeObjectURL(el.src);
    const file = input.files[0];
    if (!file) { el.removeAttribute("src"); el.hidden = true; return; }
    el.src = URL.createObjectURL(file);
    el.hidden = false;
  };
}

async function submit(event) {
  event.preventDefault();
  const form = event.target;
  for (const e of form.querySelectorAll("[data-error-for]")) e.textContent = "";
  const data = new FormData();
  for (const input of form.querySelectorAll('input[type="file"]')) {
    const file = input.files[0];
    if (file) data.append(input.name, file, file.name);
  }
  for (const f of fields) {
    const value = form.elements[f.name].value;
    if (value !== "") data.append(f.name, value);
  }
  $("#submit-button").disabled = true;
  try {
    await withToken(async () => {
      const r = await api("/v1/videos", { method: "POST", body: data });
      if (!r.ok) {
        const text = await r.text();
        let error;
        try { error = JSON.parse(text).error; } catch { error = { message: `${r.status}: ${text.slice(0, 200)}` }; }
        const param = error.param || "";
        const slot = form.querySelector(`[data-error-for="${CSS.escape(param)}"]`) || form.querySelector('[data-error-for=""]');
        slot.textContent = error.message;
        return;
      }
      const v = await r.json();
      known.set(v.id, v);
      renderJobs([...known.values()]);
    });
  } catch (e) {
    form.querySelector('[data-error-for=""]').textContent = `could not submit: ${e.message}`;
  } finally {
    $("#submit-button").disabled = false;
  }
}

// ----- a live session (--mode live): speech in (the microphone, or a file), the avatar out over WebRTC (WHEP) -----
const PCM_RATE = 16000; // what the session's speech URL is sent: 16-bit mono PCM at 16 kHz
const PCM_CHUNK = 2560; // samples a POST (160 ms)
// the microphone's samples, at the AudioContext's rate, averaged down to 16 kHz (each output sample
// the mean of the input samples since the last: a box low-pass) and posted as 160 ms of Int16 PCM
const PCM_WORKLET = `
class Pcm16k extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = sampleRate / ${PCM_RATE}; this.next = this.step; this.pos = 0; this.sum = 0; this.n = 0;
    this.buf = new Int16Array(${PCM_CHUNK}); this.fill = 0;
  }
  process(inputs) {
    const ch = inputs[0] && inputs[0][0];
    if (!ch) return true;
    for (let i = 0; i < ch.length; i++) {
      this.sum += ch[i]; this.n++; this.pos++;
      if (this.pos < this.next) continue;
      this.next += this.step;
      const v = Math.max(-1, Math.min(1, this.sum / this.n));
      this.sum = 0; this.n = 0;
      this.buf[this.fill++] = Math.round(v < 0 ? v * 32768 : v * 32767);
      if (this.fill === this.buf.length) {
        this.port.postMessage(this.buf.buffer, [this.buf.buffer]);
        this.buf = new Int16Array(${PCM_CHUNK}); this.fill = 0;
      }
    }
    return true;
  }
}
registerProcessor("pcm-16k", Pcm16k);`;
const live = { session: null, pc: null, viewer: null, audio: null, timer: null, queue: [], sending: false };

function showSession(s) {
  live.session = s;
  const panel = $("#session");
  panel.dataset.sessionId = s.id;
  panel.dataset.state = s.state;
  $("#session-state").textContent = `${s.id}: ${s.state}${s.ended_by ? ` (ended by ${s.ended_by})` : ""}`;
  const v = s.video || {};
  const blocks = v.blocks_done !== undefined && v.blocks_done !== null ? ` · ${v.blocks_done} blocks made` : "";
  $("#session-detail").textContent = `${s.speech_s.toFixed(1)} s of speech sent${blocks}` +
    (s.interrupts ? ` · ${s.interrupts} interrupt${s.interrupts === 1 ? "" : "s"}` : "");
  const open = s.state === "open";
  $("#session-interrupt").disabled = !open;
  $("#session-end").disabled = !open;
  $("#session-start").disabled = s.state !== "ended";
}

function sessionError(message) {
  $("#session-error").textContent = message || "";
}

// 16-bit PCM chunks in order, one POST at a time (what came meanwhile goes in the next)
async function sendSpeech(pcm) {
  live.queue.push(new Int16Array(pcm));
  if (live.sending) return;
  live.sending = true;
  try {
    while (live.queue.length && live.session && live.session.state === "open") {
      const parts = live.queue.splice(0);
      const body = new Int16Array(parts.reduce((n, p) => n + p.length, 0));
      let at = 0;
      for (const p of parts) { body.set(p, at); at += p.length; }
      const r = await api(`${live.session.speech_url}?format=s16le&rate=${PCM_RATE}`, {
        method: "POST", headers: { "Content-Type": "application/octet-stream" }, body });
      if (r.ok) showSession(await r.json());
      else { sessionError(await errorMessage(r)); if (r.status === 409 || r.status === 404) stopSpeech(); }
    }
  } catch (e) {
    sessionError(`speech not sent: ${e.message}`);
  } finally {
    live.sending = false;
  }
}

async function startMicrophone() {
  const stream = await navigator.mediaDevices.getUserMedia({
    audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true } });
  const ctx = new AudioContext();
  const url = URL.createObjectURL(new Blob([PCM_WORKLET], { type: "text/javascript" }));
  try { await ctx.audioWorklet.addModule(url); } finally { URL.revokeObjectURL(url); }
  const node = new AudioWorkletNode(ctx, "pcm-16k", { numberOfInputs: 1, numberOfOutputs: 0, channelCount: 1 });
  node.port.onmessage = (e) => sendSpeech(e.data);
  ctx.createMediaStreamSource(stream).connect(node);
  live.audio = { ctx, stream };
}

// an audio file: decoded and resampled to 16 kHz by the browser, sent 160 ms at a time as it would be spoken
async function startFile(file) {
  const decoded = await new AudioContext().decodeAudioData(await file.arrayBuffer());
  const offline = new OfflineAudioContext(1, Math.ceil(decoded.duration * PCM_RATE), PCM_RATE);
  const source = offline.createBufferSource();
  source.buffer = decoded;
  source.connect(offline.destination);
  source.start();
  const samples = (await offline.startRendering()).getChannelData(0);
  let at = 0;
  live.timer = setInterval(() => {
    if (at >= samples.length) { stopSpeech(); return; }
    const part = samples.subarray(at, at + PCM_CHUNK);
    at += PCM_CHUNK;
    sendSpeech(Int16Array.from(part, (v) => Math.round(Math.max(-1, Math.min(1, v)) * 32767)).buffer);
  }, (PCM_CHUNK / PCM_RATE) * 1000);
}

function stopSpeech() {
  if (live.timer) clearInterval(live.timer);
  live.timer = null;
  if (live.audio) {
    for (const t of live.audio.stream.getTracks()) t.stop();
    live.audio.ctx.close();
  }
  live.audio = null;
}

function iceGathered(pc, timeoutMs = 3000) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((done) => {
    const check = () => { if (pc.iceGatheringState === "complete") done(); };
    pc.addEventListener("icegatheringstatechange", check);
    setTimeout(done, timeoutMs); // what was gathered by then goes (host candidates come first)
  });
}

// WHEP: our offer (recvonly video and audio, its candidates gathered) POSTed as application/sdp;
// the answer's tracks play in the <video>
async function watchSession(url) {
  const pc = new RTCPeerConnection();
  live.pc = pc;
  pc.addTransceiver("video", { direction: "recvonly" });
  pc.addTransceiver("audio", { direction: "recvonly" });
  const stream = new MediaStream();
  const video = $("#session-video");
  pc.ontrack = (e) => stream.addTrack(e.track);
  pc.onconnectionstatechange = () => { // the server closes it when the session's video has all been sent
    if (live.pc === pc && ["failed", "closed"].includes(pc.connectionState)) stopWatching();
  };
  video.srcObject = stream;
  video.hidden = false;
  await pc.setLocalDescription(await pc.createOffer());
  await iceGathered(pc);
  const r = await api(url, { method: "POST", headers: { "Content-Type": "application/sdp" }, body: pc.localDescription.sdp });
  if (r.status !== 201) throw new Error(await errorMessage(r));
  live.viewer = new URL(r.headers.get("Location"), location.href).pathname;
  await pc.setRemoteDescription({ type: "answer", sdp: await r.text() });
  video.play().catch(() => { video.muted = true; video.play().catch(() => {}); }); // sound needs a click somewhere
}

async function stopWatching() {
  if (live.pc) live.pc.close();
  live.pc = null;
  if (live.viewer) await api(live.viewer, { method: "DELETE" }).catch(() => {});
  live.viewer = null;
}

async function sessionAction(action) {
  if (!live.session) return;
  if (action === "end") stopSpeech();
  try {
    await withToken(async () => {
      const r = await api(`/v1/videos/sessions/${live.session.id}/${action}`, { method: "POST" });
      if (!r.ok) { sessionError(await errorMessage(r)); return; }
      showSession(await r.json());
    });
  } catch (e) {
    sessionError(`${action} failed: ${e.message}`);
  }
}

// the session's state while it lives (its speech, its blocks; its end: the viewer let go)
async function followSession(id) {
  while (live.session && live.session.id === id && live.session.state !== "ended") {
    await new Promise((ok) => setTimeout(ok, 1000));
    try {
      const r = await api(`/v1/videos/sessions/${id}`);
      if (r.ok) showSession(await r.json());
    } catch (e) {
      console.error("wan-s2v session:", e);
    }
  }
  stopSpeech();
  const pc = live.pc;
  if (pc && pc.connectionState !== "connected") await stopWatching(); // else its tracks end with the video
}

async function startSession(event) {
  event.preventDefault();
  const form = event.target;
  sessionError("");
  const image = form.elements.session_image.files[0];
  const fromFile = form.elements.session_speech.value === "file";
  const audio = form.elements.session_audio.files[0];
  if (!image) { sessionError("pick a reference image first"); return; }
  if (fromFile && !audio) { sessionError("pick an audio file, or speak from the microphone"); return; }
  $("#session-start").disabled = true;
  await stopWatching();
  try {
    await withToken(async () => {
      const data = new FormData();
      data.append("image", image, image.name);
      data.append("pace", "realtime");
      const r = await api("/v1/videos/sessions", { method: "POST", body: data });
      if (r.status !== 201) throw new Error(await errorMessage(r));
      showSession(await r.json());
    });
    const s = live.session;
    if (fromFile) await startFile(audio); // the microphone first: its permission lets the offer name the host's addresses
    else await startMicrophone();
    await withToken(() => watchSession(s.whep_url));
    followSession(s.id);
  } catch (e) {
    sessionError(`the session could not start: ${e.message}`);
    stopSpeech();
    if (live.session && live.session.state === "open") sessionAction("end");
    $("#session-start").disabled = false;
  }
}

async function main() {
  preview($('input[name="image"]'), $("#image-preview"));
  preview($('input[name="audio"]'), $("#audio-preview"));
  preview($('input[name="pose_video"]'), $("#pose-preview"));
  preview($('input[name="tts_prompt_audio"]'), $("#tts-prompt-preview"));
  $("#submit-form").addEventListener("submit", submit);
  preview($('input[name="session_image"]'), $("#session-image-preview"));
  $("#session-form").addEventListener("submit", startSession);
  $("#session-interrupt").onclick = () => sessionAction("interrupt");
  $("#session-end").onclick = () => sessionAction("end");
  const info = await withToken(async () => (await api("/v1/server")).json());
  if ($("#token-dialog").open) $("#token-dialog").close();
  renderServer(info);
  buildForm(info.fields, info.max_upload_mb);
  $("#session").hidden = info.layout.mode !== "live"; // sessions: a --mode live server's
  document.body.dataset.ready = "1";
  follow();
}

main();
