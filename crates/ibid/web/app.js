// The ibid dashboard: a client of the public HTTP API (/api/v1), no framework.
// Every name and message from the server is put in the page as text (textContent, attributes
// set one by one): nothing here parses HTML, so a hostile name cannot become markup.

const API = '/api/v1';
const TOKEN_KEY = 'ibid-token';
const RANGES = [[300, '5 min'], [900, '15 min'], [3600, '1 h'], [21600, '6 h'], [86400, '24 h']];
const FORMATS = ['thin', 'lazyzeroedthick', 'eagerzeroedthick'];
const SHORT_FORMAT = { thin: 'thin', lazyzeroedthick: 'lazy thick', eagerzeroedthick: 'eager thick' };
const POLL_MS = 2000;
const POOL_POLL_MS = 5000;

const state = {
  token: sessionStorage.getItem(TOKEN_KEY) || '',
  pool: null,
  poolError: null,
  poolFailed: null,
  schedules: [],
  scrub: null,
  server: null,
  range: 900,
  charts: [],
  timers: [],
  page: null,
};

// ---------- DOM helpers ----------

/** Makes an element: h('a', {href: '#/', class: 'x', onclick: f}, 'text', child, ...). */
function h(tag, attrs, ...kids) {
  const el = tag.startsWith('svg:')
    ? document.createElementNS('http://www.w3.org/2000/svg', tag.slice(4))
    : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else if (k === 'class') el.setAttribute('class', v);
    else if (k === 'value') el.value = v;
    else if (k === 'checked') el.checked = !!v;
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  append(el, kids);
  return el;
}

function append(el, kids) {
  for (const k of kids.flat(Infinity)) {
    if (k === undefined || k === null || k === false) continue;
    el.append(k instanceof Node ? k : document.createTextNode(String(k)));
  }
  return el;
}

function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

function $(sel) { return document.querySelector(sel); }

// ---------- Formatting ----------

const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB', 'EiB'];

function fmtBytes(n) {
  if (n === null || n === undefined) return '–';
  let i = 0;
  let x = Number(n);
  while (Math.abs(x) >= 1024 && i < UNITS.length - 1) { x /= 1024; i++; }
  const digits = i === 0 || x >= 100 ? 0 : 1;
  return `${x.toFixed(digits).replace(/\.0$/, '')} ${UNITS[i]}`;
}

function fmtNum(n, digits = 0) {
  if (n === null || n === undefined || Number.isNaN(n)) return '–';
  return Number(n).toLocaleString('en-US', { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

function fmtPct(x) { return `${fmtNum(x * 100, x < 0.1 ? 1 : 0)} %`; }

function fmtTime(unixS) {
  if (!unixS) return '–';
  return new Date(unixS * 1000).toISOString().replace('T', ' ').replace(/\.\d+Z$/, ' UTC');
}

function fmtAge(s) {
  if (s < 120) return `${fmtNum(s)} s`;
  if (s < 7200) return `${fmtNum(s / 60)} min`;
  return `${fmtNum(s / 3600, 1)} h`;
}

function ratio(x) { return `${fmtNum(x, x >= 100 ? 0 : 2)} : 1`; }

// ---------- API ----------

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** Calls the API; resolves with the JSON answer (null for 204), rejects with an ApiError. */
async function api(method, path, body) {
  const headers = { Accept: 'application/json' };
  if (state.token) headers.Authorization = `Bearer ${state.token}`;
  // State changes carry the header the server requires (other sites' pages cannot send it).
  if (method !== 'GET') headers['X-Ibid-Request'] = '1';
  const init = { method, headers, cache: 'no-store' };
  if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  let r;
  try {
    r = await fetch(API + path, init);
  } catch (e) {
    setConn(false);
    throw new ApiError(0, 'unreachable', `cannot reach the server: ${e.message}`);
  }
  setConn(true);
  const text = await r.text();
  let json = null;
  try { json = text ? JSON.parse(text) : null; } catch (_) { json = null; }
  if (r.status === 401) {
    showLogin(state.token ? 'The token was refused.' : '');
    throw new ApiError(401, 'unauthorized', 'this server requires its API token');
  }
  if (!r.ok) {
    throw new ApiError(r.status, json && json.code, (json && json.message) || `HTTP ${r.status}`);
  }
  return json;
}

function setConn(ok) {
  const el = $('#conn-state');
  el.textContent = ok ? '' : 'Server unreachable';
  el.classList.toggle('error', !ok);
}

const seg = (name) => encodeURIComponent(name);

// ---------- Login ----------

let loginOpen = false;

function showLogin(message) {
  const dlg = $('#login');
  $('#login-error').textContent = message || '';
  if (!loginOpen) {
    loginOpen = true;
    dlg.showModal();
    $('#login-token').focus();
  }
}

function initLogin() {
  const dlg = $('#login');
  dlg.addEventListener('cancel', (e) => e.preventDefault());
  $('#login-form').addEventListener('submit', async (e) => {
    e.preventDefault();
    state.token = $('#login-token').value.trim();
    try {
      await api('GET', '/pool?sync=false');
    } catch (err) {
      if (err.status === 401) return; // showLogin already said so
      $('#login-error').textContent = err.message;
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, state.token);
    $('#sign-out').hidden = false;
    loginOpen = false;
    dlg.close();
    $('#login-token').value = '';
    await refreshPool();
    render();
  });
}

// ---------- Confirmation ----------

/** Asks to confirm a destructive action by typing `expect`; resolves true if confirmed. */
function confirmAction({ title, body, expect, ok }) {
  const dlg = $('#confirm');
  const input = $('#confirm-input');
  const okBtn = $('#confirm-ok');
  $('#confirm-title').textContent = title;
  append(clear($('#confirm-body')), body);
  $('#confirm-label').textContent = `Type ${expect} to confirm`;
  input.value = '';
  okBtn.textContent = ok;
  okBtn.disabled = true;
  return new Promise((resolve) => {
    const onInput = () => { okBtn.disabled = input.value !== expect; };
    const done = (answer) => {
      input.removeEventListener('input', onInput);
      $('#confirm-form').removeEventListener('submit', onSubmit);
      $('#confirm-cancel').removeEventListener('click', onCancel);
      dlg.removeEventListener('close', onClose);
      if (dlg.open) dlg.close();
      resolve(answer);
    };
    const onSubmit = (e) => { e.preventDefault(); if (input.value === expect) done(true); };
    const onCancel = () => done(false);
    const onClose = () => done(false);
    input.addEventListener('input', onInput);
    $('#confirm-form').addEventListener('submit', onSubmit);
    $('#confirm-cancel').addEventListener('click', onCancel);
    dlg.addEventListener('close', onClose);
    dlg.showModal();
    input.focus();
  });
}

// ---------- Feedback ----------

function toast(message) {
  const t = $('#toast');
  t.textContent = message;
  t.classList.add('shown');
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => t.classList.remove('shown'), 4000);
}

/** Runs an action from a form: shows its error in `errEl`, or `success` as a toast. */
async function act(errEl, button, fn, success) {
  errEl.textContent = '';
  if (button) button.disabled = true;
  try {
    const result = await fn();
    if (success) toast(typeof success === 'function' ? success(result) : success);
    return result;
  } catch (e) {
    errEl.textContent = e.code ? `${e.message} (${e.code})` : e.message;
    return undefined;
  } finally {
    if (button) button.disabled = false;
  }
}

// ---------- Health ----------

/** What is wrong with the pool, most serious first; empty when all is well. */
function problems() {
  const out = [];
  if (state.poolFailed) {
    // The engine stopped writing after an I/O error or damage met by a metadata commit: it
    // never retries a failed write or sync. What to do is the same whatever failed.
    const why = state.poolFailed.replace(/^the pool has failed after an earlier error and must be reopened: /, '');
    out.push(['error', 'The pool has failed and stopped writing.',
      h('span', {}, 'What failed: ', h('strong', {}, why)),
      h('span', {}, 'What to do: check the disk and filesystem under the pool (kernel log, free space, SMART), then restart ',
        h('code', {}, 'ibid serve'), ': the pool reopens from its last commit and journal, with every write acknowledged before the failure. Then run ',
        h('code', {}, 'ibid pool verify'), '. Until then, reads may work; writes, snapshots and changes fail.')]);
    return out;
  }
  if (state.poolError) {
    out.push(['error', `The pool cannot be read: ${state.poolError}`]);
    return out;
  }
  const p = state.pool;
  if (p) {
    const full = (p.used_bytes + p.reserved_bytes) / Math.max(1, p.capacity_bytes);
    const fsLow = p.filesystem_free_bytes < p.filesystem_reserve_bytes;
    if (p.free_bytes === 0 || fsLow) {
      out.push(['error', fsLow
        ? `Out of space: the filesystem under the pool has ${fmtBytes(p.filesystem_free_bytes)} available, under its ${fmtBytes(p.filesystem_reserve_bytes)} reserve; writes of new data fail.`
        : `Out of space: the pool's ${fmtBytes(p.capacity_bytes)} are used or reserved; writes of new data to thin volumes fail.`]);
    } else if (p.soft_threshold_exceeded) {
      const fsNear = p.filesystem_free_bytes < 2 * p.filesystem_reserve_bytes;
      out.push(['warn', fsNear && full * 100 < p.soft_threshold_pct
        ? `The filesystem under the pool is nearly full: ${fmtBytes(p.filesystem_free_bytes)} available.`
        : `The pool is ${fmtPct(full)} full, past its soft threshold of ${p.soft_threshold_pct} %: add capacity or free space.`]);
    }
  }
  const s = state.scrub;
  if (s) {
    if (s.damaged && s.damaged.length) {
      out.push(['error', `The background scrub found ${s.damaged.length} damaged chunk${s.damaged.length === 1 ? '' : 's'} (see Pool).`]);
    }
    if (s.error) out.push(['error', `The background scrub failed: ${s.error}`]);
  }
  // Snapshot schedules: a failed last run, or a run overdue by more than a minute (and a
  // tenth of the interval).
  for (const x of state.schedules || []) {
    if (x.last_error) {
      const retry = x.push_retry_snapshot ? ` The push of ${x.push_retry_snapshot} is tried again at ${fmtTime(x.push_retry_unix_s)}.` : '';
      out.push(['warn', `The snapshot schedule of ${x.volume} failed (last run ${fmtTime(x.last_run_unix_s)}): ${x.last_error}${retry}`]);
    } else if (x.lag_s > Math.max(60, x.every_s / 10)) {
      out.push(['warn', `The snapshot schedule of ${x.volume} is ${fmtAge(x.lag_s)} late.`]);
    }
  }
  return out;
}

function renderHealth() {
  const el = $('#health');
  const list = problems();
  clear(el);
  el.hidden = list.length === 0;
  el.className = list.some(([k]) => k === 'error') ? 'health error' : 'health warn';
  el.classList.toggle('failed', Boolean(state.poolFailed));
  for (const [kind, msg, ...more] of list) {
    append(el, [h('p', { class: kind }, more.length ? h('strong', {}, msg) : msg)]);
    for (const m of more) append(el, [h('p', { class: 'detail' }, m)]);
  }
}

async function refreshPool(exact = false) {
  try {
    // Polls ask for the figures as of the last commit: an exact answer commits and folds the
    // pool's reference log, which polling every few seconds would force on a busy pool.
    state.pool = await api('GET', exact ? '/pool' : '/pool?sync=false');
    state.poolError = null;
    state.poolFailed = null;
  } catch (e) {
    if (e.status === 401 || e.status === 0) return;
    if (e.code === 'pool_failed') state.poolFailed = e.message;
    else state.poolError = e.message;
  }
  try { state.scrub = await api('GET', '/pool/scrub'); } catch (_) { /* shown with the pool */ }
  try { state.schedules = await api('GET', '/schedules'); } catch (_) { /* shown with the pool */ }
  renderHealth();
}

// ---------- Charts ----------

function uplotReady() { return typeof window.uPlot === 'function'; }

const SERIES = {
  iops: { title: 'IOPS', cols: ['read_iops', 'write_iops'], scale: 1, unit: 'IOPS' },
  mbps: { title: 'Throughput (MiB/s)', cols: ['read_bytes_per_s', 'write_bytes_per_s'], scale: 1 / 1048576, unit: 'MiB/s' },
  lat: { title: 'Latency (µs)', cols: ['read_latency_us', 'write_latency_us'], scale: 1, unit: 'µs' },
};

function chartData(hist, kind) {
  const k = SERIES[kind];
  return [hist.t, ...k.cols.map((c) => hist[c].map((v) => (v === null ? null : v * k.scale)))];
}

function makeChart(el, kind, hist) {
  const k = SERIES[kind];
  const width = Math.max(240, el.clientWidth || 300);
  const opts = {
    width,
    height: 160,
    legend: { show: true },
    cursor: { drag: { x: false, y: false } },
    scales: { x: { time: true } },
    axes: [{}, { size: 60, values: (u, vals) => vals.map((v) => fmtNum(v, 1)) }],
    series: [
      {},
      { label: 'read', stroke: '#2563eb', width: 1.5, points: { show: false }, spanGaps: false, value: (u, v) => (v === null ? '–' : `${fmtNum(v, 1)} ${k.unit}`) },
      { label: 'write', stroke: '#d97706', width: 1.5, points: { show: false }, spanGaps: false, value: (u, v) => (v === null ? '–' : `${fmtNum(v, 1)} ${k.unit}`) },
    ],
  };
  const chart = new window.uPlot(opts, chartData(hist, kind), el);
  return { chart, kind, el };
}

function chartsBlock(idPrefix, label) {
  const wrap = h('div', { class: 'charts' });
  for (const kind of Object.keys(SERIES)) {
    wrap.append(h('figure', { class: 'chart' },
      h('figcaption', { id: `${idPrefix}-${kind}-cap` }, SERIES[kind].title),
      h('div', { class: 'plot', id: `${idPrefix}-${kind}`, role: 'img', 'aria-labelledby': `${idPrefix}-${kind}-cap ${idPrefix}-now` })));
  }
  return h('section', { class: 'card', 'aria-label': label },
    h('div', { class: 'row' },
      h('h2', {}, label),
      h('div', { class: 'ranges', role: 'group', 'aria-label': 'Time range' },
        idPrefix === 'pool' ? RANGES.map(([s, l]) => h('button', {
          type: 'button', 'aria-pressed': String(s === state.range), 'data-range': s,
          onclick: () => { state.range = s; render(); },
        }, l)) : h('span', { class: 'muted' }, 'last 15 min, 5 s steps'))),
    h('p', { class: 'now', id: `${idPrefix}-now`, 'aria-live': 'off' }, 'No I/O yet.'),
    wrap);
}

/** Draws or updates the three charts of `idPrefix` from a history answer. */
function drawCharts(idPrefix, hist) {
  const last = hist.t.length - 1;
  const now = $(`#${idPrefix}-now`);
  if (now) {
    if (last < 0) {
      now.textContent = 'No samples yet.';
      now.dataset.iops = '0';
    } else {
      const r = hist.read_iops[last] || 0;
      const w = hist.write_iops[last] || 0;
      const mib = ((hist.read_bytes_per_s[last] || 0) + (hist.write_bytes_per_s[last] || 0)) / 1048576;
      const rl = hist.read_latency_us[last];
      const wl = hist.write_latency_us[last];
      now.dataset.iops = String(r + w);
      now.textContent = `Latest: ${fmtNum(r + w)} IOPS (read ${fmtNum(r)}, write ${fmtNum(w)}), ${fmtNum(mib, 1)} MiB/s, latency read ${rl === null ? '–' : `${fmtNum(rl)} µs`}, write ${wl === null ? '–' : `${fmtNum(wl)} µs`}`;
    }
  }
  if (!uplotReady()) return;
  for (const kind of Object.keys(SERIES)) {
    const el = document.getElementById(`${idPrefix}-${kind}`);
    if (!el) continue;
    const existing = state.charts.find((c) => c.el === el);
    if (existing) existing.chart.setData(chartData(hist, kind));
    else state.charts.push(makeChart(el, kind, hist));
  }
}

window.addEventListener('resize', () => {
  for (const c of state.charts) c.chart.setSize({ width: Math.max(240, c.el.clientWidth), height: 160 });
});

function sparkline(values) {
  const w = 80;
  const hgt = 20;
  const svg = h('svg:svg', { width: w, height: hgt, viewBox: `0 0 ${w} ${hgt}`, class: 'spark', 'aria-hidden': 'true' });
  if (!values || values.length < 2) return svg;
  const max = Math.max(1, ...values);
  const pts = values.map((v, i) => `${((i / (values.length - 1)) * w).toFixed(1)},${(hgt - 1 - (v / max) * (hgt - 2)).toFixed(1)}`);
  svg.append(h('svg:polyline', { points: pts.join(' '), fill: 'none', stroke: 'currentColor', 'stroke-width': '1.2' }));
  return svg;
}

// ---------- Pages ----------

/** Runs `fn` every `ms` while the page that asked is shown. */
function every(ms, fn) {
  const page = state.page;
  const id = setInterval(() => {
    if (state.page !== page) clearInterval(id);
    else fn();
  }, ms);
  state.timers.push(id);
}

function stopPage() {
  for (const id of state.timers) clearInterval(id);
  state.timers = [];
  for (const c of state.charts) c.chart.destroy();
  state.charts = [];
}

function nbdHost() {
  const s = state.server;
  if (!s) return null;
  const [host, port] = splitAddr(s.nbd);
  return `${unspecified(host) ? location.hostname : host}:${port}`;
}

function iscsiPortal() {
  const s = state.server;
  if (!s || !s.iscsi) return null;
  const [host, port] = splitAddr(s.iscsi);
  return `${unspecified(host) ? location.hostname : host}:${port}`;
}

function splitAddr(a) {
  const i = a.lastIndexOf(':');
  return [a.slice(0, i), a.slice(i + 1)];
}

function unspecified(host) { return host === '0.0.0.0' || host === '[::]'; }

async function loadServer() {
  if (!state.server) state.server = await api('GET', '/server');
  return state.server;
}

function figure(label, value, note) {
  return h('div', { class: 'figure' },
    h('div', { class: 'label' }, label),
    h('div', { class: 'value' }, value),
    note ? h('div', { class: 'note' }, note) : null);
}

/**
 * The data part of the capacity bar: unique, shared and snapshot-only from the server's
 * background breakdown (`p.breakdown`, computed every minute or so). Data written since then
 * is a part of its own ("not yet classified"); when data was freed since, the three are
 * scaled down to today's physical bytes (the legend then says "about"). One "data" part
 * until the first breakdown.
 */
function dataParts(p) {
  const b = p.breakdown;
  const sum = b ? b.unique_physical_bytes + b.shared_physical_bytes + b.snapshot_only_physical_bytes : 0;
  if (!b || sum === 0) return [['data', 'Data (after dedup and compression)', p.physical_bytes]];
  const k = Math.min(1, p.physical_bytes / sum);
  const about = k < 1 ? 'about ' : '';
  const part = (cls, label, v) => [cls, label, v * k, `${about}${fmtBytes(Math.round(v * k))}`];
  const out = [
    part('uniq', 'Unique data (one volume alone holds it)', b.unique_physical_bytes),
    part('shrd', 'Shared data (deduplicated, cloned, or also a snapshot\'s)', b.shared_physical_bytes),
    part('snap', 'Snapshot-only data (no volume shows it: kept by snapshots, until the cleaner merges a deleted one\'s layer, or until a commit frees overwritten data)', b.snapshot_only_physical_bytes),
  ];
  if (p.physical_bytes > sum) out.push(['pend', 'Data written since the split was computed (not yet classified)', p.physical_bytes - sum]);
  return out;
}

function capacityBar(p) {
  const dataReserved = p.reserved_bytes - p.overwrite_headroom_bytes;
  // Garbage is dead bytes in segment files the cleaner has yet to reclaim: counted as free
  // (the capacity does not count it), so it is drawn as the first part of the free space.
  const garbage = Math.min(p.garbage_bytes, p.free_bytes);
  const parts = [
    ...dataParts(p),
    ['meta', 'Metadata', p.metadata_bytes],
    ['resv', 'Thick reservations', dataReserved],
    ['head', 'Overwrite headroom', p.overwrite_headroom_bytes],
    ['garbage', 'Garbage awaiting the cleaner (counted as free)', garbage],
    ['free', 'Free', p.free_bytes - garbage],
  ];
  const total = Math.max(1, p.capacity_bytes);
  const bar = h('div', { class: 'bar', role: 'img', 'aria-label': `Capacity ${fmtBytes(p.capacity_bytes)}: ${parts.map(([, l, v, shown = fmtBytes(v)]) => `${l} ${shown}`).join(', ')}` });
  for (const [cls, label, v, shown = fmtBytes(v)] of parts) {
    if (v <= 0) continue;
    const s = h('span', { class: `seg ${cls}`, title: `${label}: ${shown}` });
    s.style.width = `${Math.max(0.3, (v / total) * 100)}%`;
    bar.append(s);
  }
  const threshold = h('span', { class: 'threshold', title: `Soft threshold ${p.soft_threshold_pct} %` });
  threshold.style.left = `${p.soft_threshold_pct}%`;
  bar.append(threshold);
  const legend = h('ul', { class: 'legend' },
    parts.map(([cls, label, v, shown = fmtBytes(v)]) => h('li', { 'data-part': cls }, h('span', { class: `swatch ${cls}` }), `${label}: `, h('strong', {}, shown), ` (${fmtPct(v / total)})`)),
    h('li', {}, h('span', { class: 'swatch tick' }), `Soft threshold: ${p.soft_threshold_pct} %`));
  const b = p.breakdown;
  const note = h('p', { class: 'muted', id: 'breakdown-age' }, b
    ? `Unique, shared and snapshot-only as computed ${fmtAge(b.age_s)} ago (in ${fmtNum(b.took_ms, 1)} ms; the server walks every volume's map in the background, at most once a minute)${b.error ? `; the last attempt failed: ${b.error}` : ''}. `
    : 'The split of the data into unique, shared and snapshot-only is being computed. ');
  const recompute = h('button', { type: 'button', class: 'small', id: 'breakdown-now' }, 'Recompute now');
  recompute.addEventListener('click', async () => {
    recompute.disabled = true;
    try {
      p.breakdown = await api('POST', '/pool/breakdown');
      if (state.pool) state.pool.breakdown = p.breakdown;
      toast('Space breakdown recomputed');
      render();
    } catch (e) { toast(e.message); } finally { recompute.disabled = false; }
  });
  note.append(recompute);
  return [bar, legend, note];
}

async function pageOverview(main) {
  const top = h('section', { class: 'card' }, h('h2', {}, 'Capacity'), h('p', { class: 'muted' }, 'Loading…'));
  const perf = chartsBlock('pool', 'Performance');
  const hints = h('section', { class: 'card' }, h('h2', {}, 'Connect'));
  append(main, [h('h1', {}, 'Overview'), top, perf, hints]);

  const drawTop = () => {
    const p = state.pool;
    if (!p) return;
    const usedAll = p.used_bytes + p.reserved_bytes;
    const thinSaved = Math.max(0, p.provisioned_bytes - p.logical_written_bytes);
    // written ÷ distinct blocks, and distinct blocks ÷ their stored bytes: the ratio's factors.
    const dedup = p.unique_bytes ? p.logical_written_bytes / p.unique_bytes : 1;
    const compression = p.physical_bytes ? p.unique_bytes / p.physical_bytes : 1;
    clear(top);
    append(top, [
      h('h2', {}, 'Capacity'),
      state.poolFailed ? h('p', { class: 'error', id: 'capacity-stale' }, 'The pool has failed: these figures are from before the failure.') : null,
      h('div', { class: 'figures' },
        figure('Used and reserved', `${fmtBytes(usedAll)} of ${fmtBytes(p.capacity_bytes)}`, fmtPct(usedAll / Math.max(1, p.capacity_bytes))),
        figure('Data reduction', ratio(p.data_reduction_ratio), `${fmtBytes(p.logical_written_bytes)} written, ${fmtBytes(p.physical_bytes)} stored: dedup ${fmtNum(dedup, 2)} × compression ${fmtNum(compression, 2)}`),
        figure('Thin provisioning saves', fmtBytes(thinSaved), 'provisioned but never written; not in the ratio'),
        figure('Provisioned', fmtBytes(p.provisioned_bytes), `${fmtPct(p.provisioned_bytes / Math.max(1, p.capacity_bytes))} of capacity${p.provisioned_bytes > p.capacity_bytes ? ` (overcommitted ${fmtPct(p.provisioned_bytes / p.capacity_bytes - 1)})` : ''}`),
        figure('Volumes', fmtNum(p.volumes), `thick: ${fmtBytes(p.thick_provisioned_bytes)}`),
        figure('Free', fmtBytes(p.free_bytes), `filesystem: ${fmtBytes(p.filesystem_free_bytes)} available`)),
      capacityBar(p),
    ]);
  };

  const drawHints = async () => {
    // No volume listing here: with thousands of volumes it would cost the overview most of
    // its load time; each volume's page has its own strings.
    const s = await loadServer();
    const example = 'VOLUME';
    const lun = 'LUN';
    clear(hints);
    append(hints, [
      h('h2', {}, 'Connect'),
      h('dl', { class: 'hints' },
        h('dt', {}, 'NBD'), h('dd', {}, h('code', {}, `nbd://${nbdHost()}/VOLUME`), ' (snapshots: ', h('code', {}, 'VOLUME@SNAPSHOT'), ', read-only)'),
        s.iscsi ? [h('dt', {}, 'iSCSI portal'), h('dd', {}, h('code', {}, iscsiPortal()))] : [h('dt', {}, 'iSCSI'), h('dd', {}, 'off')],
        s.iscsi ? [h('dt', {}, 'iSCSI target'), h('dd', {}, h('code', {}, s.iqn), ' (each volume\'s LUN is in the volume table; snapshots can be exported as read-only LUNs)')] : null,
        h('dt', {}, 'Example'), h('dd', {}, h('code', {}, `nbdinfo nbd://${nbdHost()}/${example}`)),
        s.iscsi ? [h('dt', {}, ''), h('dd', {}, h('code', {}, `iscsi-inq iscsi://${iscsiPortal()}/${s.iqn}/${lun}`))] : null,
        h('dt', {}, 'Server'), h('dd', {}, `ibid ${s.version}`)),
    ]);
  };

  const drawPerf = async () => {
    const hist = await api('GET', `/stats/history?seconds=${state.range}`);
    drawCharts('pool', hist);
  };

  drawTop();
  await Promise.all([drawPerf(), drawHints()]);
  every(POOL_POLL_MS, drawTop);
  every(state.range <= 900 ? POLL_MS : 30000, () => drawPerf().catch(() => {}));
}

// Volumes table

const COLUMNS = [
  ['name', 'Name', (v) => v.name],
  ['format', 'Format', (v) => v.format],
  ['size', 'Size', (v) => v.size_bytes],
  ['written', 'Written', (v) => v.mapped_blocks * 4096],
  ['unique', 'Unique', (v) => (v.exclusive_blocks ?? -1) * 4096],
  ['shared', 'Shared', (v) => (v.shared_blocks ?? -1) * 4096],
  ['physical', 'Physical', (v) => spaceOf(v, (d) => d.physical_bytes)],
  ['reduction', 'Reduction', (v) => spaceOf(v, reductionOf)],
  ['tbz', 'TBZ', (v) => v.tbz_blocks * 4096, 'to be zeroed'],
  ['reserved', 'Reserved', (v) => v.reserved_bytes],
  ['snapshots', 'Snaps', (v) => v.snapshots, 'snapshots'],
  ['lun', 'LUN', (v) => v.lun ?? -1, 'iSCSI LUN'],
  ['schedule', 'Schedule', (v, sp, sch) => (sch[v.name] ? sch[v.name].every_s : Infinity), 'snapshot schedule'],
  ['clients', 'Clients', (v) => v.clients.length],
  ['iops', 'IOPS (5 min)', (v, sp) => last(sp[v.name])],
];

function last(a) { return a && a.length ? a[a.length - 1] : 0; }

// Unique and shared come with the listing for every row: the server's background breakdown
// (one walk of all the maps at most once a minute; its age is on the overview). Physical and
// reduction need the set of distinct chunks each volume references, which only `describe`'s
// walk of that one volume gives: too dear for every volume on every refresh, so the table asks
// for the rows it shows when they are few, one volume at a time, and keeps each for a minute.
const SPACE_ROWS_MAX = 50;
const SPACE_MAX_AGE_MS = 60000;
const spaceCache = new Map();

function spaceOf(v, f) {
  const d = spaceCache.get(v.name);
  return d ? f(d) : -1;
}

function reductionOf(d) {
  return d.physical_bytes ? (d.mapped_blocks * 4096) / d.physical_bytes : 0;
}

/** The text of a space cell: the figure, "…" while asked for, "–" when not asked for. */
function spaceText(v, key, asking) {
  const d = spaceCache.get(v.name);
  if (!d) return asking ? '…' : '–';
  if (key === 'physical') return fmtBytes(d.physical_bytes);
  return d.physical_bytes ? ratio(reductionOf(d)) : '–';
}

const tableState = { sort: 'name', dir: 1, filter: '' };

async function pageVolumes(main) {
  const err = h('p', { class: 'error', role: 'alert' });
  const name = h('input', { id: 'new-name', name: 'name', required: true, autocomplete: 'off', spellcheck: 'false' });
  const size = h('input', { id: 'new-size', name: 'size', required: true, placeholder: 'e.g. 10G', value: '10G' });
  const format = h('select', { id: 'new-format', name: 'format' }, FORMATS.map((f) => h('option', { value: f }, f)));
  const create = h('button', { type: 'submit', class: 'primary', id: 'create-volume' }, 'Create volume');
  const form = h('form', { class: 'card inline', 'aria-labelledby': 'create-title' },
    h('h2', { id: 'create-title' }, 'Create a volume'),
    h('div', { class: 'fields' },
      h('div', {}, h('label', { for: 'new-name' }, 'Name'), name),
      h('div', {}, h('label', { for: 'new-size' }, 'Size (units: K, M, G, T; powers of 1024)'), size),
      h('div', {}, h('label', { for: 'new-format' }, 'Format'), format),
      h('div', { class: 'end' }, create)),
    err);
  form.addEventListener('submit', async (e) => {
    e.preventDefault();
    const made = await act(err, create, () => api('POST', '/volumes', { name: name.value.trim(), size: size.value.trim(), format: format.value }),
      (v) => `Created volume ${v.name} (${fmtBytes(v.size_bytes)}, ${v.format})`);
    if (made) { name.value = ''; await refreshTable(); }
  });

  const filter = h('input', { id: 'filter', type: 'search', placeholder: 'name or format', value: tableState.filter });
  const count = h('span', { class: 'muted', 'aria-live': 'polite' });
  const table = h('table', { class: 'volumes', id: 'volumes-table' });
  append(main, [
    h('h1', {}, 'Volumes'),
    form,
    h('section', { class: 'card', 'aria-label': 'Volume list' },
      h('div', { class: 'row' }, h('label', { for: 'filter' }, 'Filter '), filter, count),
      h('div', { class: 'scroll' }, table)),
  ]);

  let vols = [];
  let spark = {};
  let scheds = {};
  const draw = () => {
    const f = tableState.filter.toLowerCase();
    const col = COLUMNS.find((c) => c[0] === tableState.sort) || COLUMNS[0];
    const rows = vols.filter((v) => !f || v.name.toLowerCase().includes(f) || v.format.includes(f) || SHORT_FORMAT[v.format].includes(f));
    rows.sort((a, b) => {
      const x = col[2](a, spark, scheds);
      const y = col[2](b, spark, scheds);
      return (x < y ? -1 : x > y ? 1 : 0) * tableState.dir;
    });
    const asking = rows.length <= SPACE_ROWS_MAX;
    const b = state.pool && state.pool.breakdown;
    count.textContent = `${rows.length} of ${vols.length} volumes${b ? `; unique and shared as computed ${fmtAge(b.age_s)} ago` : ''}${asking ? '' : ` (physical space and reduction cost a walk of each volume's map, ~0.1 s per 256 MiB written: filter to ${SPACE_ROWS_MAX} rows or fewer to see them)`}`;
    if (asking) fillSpace(rows);
    clear(table);
    const head = h('tr', {}, COLUMNS.map(([key, label, , long]) => {
      const sorted = tableState.sort === key;
      return h('th', { scope: 'col', 'aria-sort': sorted ? (tableState.dir > 0 ? 'ascending' : 'descending') : 'none' },
        h('button', {
          type: 'button', class: 'sort', 'data-col': key, title: long, 'aria-label': long ? long[0].toUpperCase() + long.slice(1) : undefined,
          onclick: () => {
            if (tableState.sort === key) tableState.dir = -tableState.dir;
            else { tableState.sort = key; tableState.dir = 1; }
            draw();
            table.querySelector(`button[data-col="${key}"]`).focus();
          },
        }, label, sorted ? (tableState.dir > 0 ? ' ▲' : ' ▼') : ''));
    }));
    const body = document.createElement('tbody');
    for (const v of rows) {
      body.append(h('tr', { 'data-volume': v.name },
        h('th', { scope: 'row' }, h('a', { href: `#/volumes/${seg(v.name)}` }, v.name)),
        h('td', { title: v.format }, SHORT_FORMAT[v.format] || v.format),
        h('td', { class: 'num' }, fmtBytes(v.size_bytes)),
        h('td', { class: 'num' }, fmtBytes(v.mapped_blocks * 4096)),
        h('td', { class: 'num', 'data-col': 'unique' }, v.exclusive_blocks == null ? '–' : fmtBytes(v.exclusive_blocks * 4096)),
        h('td', { class: 'num', 'data-col': 'shared' }, v.shared_blocks == null ? '–' : fmtBytes(v.shared_blocks * 4096)),
        ['physical', 'reduction'].map((k) => h('td', { class: 'num', 'data-col': k }, spaceText(v, k, asking))),
        h('td', { class: 'num' }, v.tbz_blocks ? fmtBytes(v.tbz_blocks * 4096) : '–'),
        h('td', { class: 'num' }, v.reserved_bytes ? fmtBytes(v.reserved_bytes) : '–'),
        h('td', { class: 'num' }, fmtNum(v.snapshots)),
        h('td', { class: 'num', 'data-col': 'lun' }, v.lun == null ? '–' : fmtNum(v.lun)),
        h('td', { 'data-col': 'schedule' }, scheduleShort(scheds[v.name])),
        h('td', { class: 'num' }, fmtNum(v.clients.length)),
        h('td', { class: 'num spark-cell' }, sparkline(spark[v.name]), ' ', fmtNum(last(spark[v.name])))));
    }
    append(table, [h('caption', { class: 'sr-only' }, 'Volumes; column headers sort'), h('thead', {}, head), body]);
  };
  filter.addEventListener('input', () => { tableState.filter = filter.value; draw(); });

  // Asks for the space of the shown rows that have none (or a stale one), one at a time,
  // filling their cells in place (a redraw would move the keyboard focus).
  let filling = false;
  const fillSpace = async (rows) => {
    if (filling) return;
    filling = true;
    try {
      for (const v of rows) {
        const known = spaceCache.get(v.name);
        if (known && Date.now() - known.at < SPACE_MAX_AGE_MS) continue;
        if (!document.body.contains(table)) return;
        let d;
        try { d = await api('GET', `/volumes/${seg(v.name)}`); } catch (_) { continue; }
        d.at = Date.now();
        spaceCache.set(v.name, d);
        const tr = [...table.querySelectorAll('tbody tr')].find((r) => r.dataset.volume === v.name);
        if (!tr) continue;
        for (const td of tr.querySelectorAll('td[data-col="physical"], td[data-col="reduction"]')) td.textContent = spaceText(v, td.dataset.col, true);
      }
    } finally {
      filling = false;
    }
  };

  const refreshTable = async () => {
    const [v, s, sch] = await Promise.all([api('GET', '/volumes'), api('GET', '/stats/volumes?seconds=300'), api('GET', '/schedules')]);
    vols = v;
    spark = s.volumes;
    scheds = Object.fromEntries(sch.map((x) => [x.volume, x]));
    draw();
  };
  await refreshTable();
  // The periodic refresh leaves the table alone while the keyboard focus is in it (a redraw
  // would take the focus away).
  every(POOL_POLL_MS, () => {
    if (!table.contains(document.activeElement)) refreshTable().catch(() => {});
  });
}

// One volume

function field(id, label, input) {
  return h('div', {}, h('label', { for: id }, label), input);
}

function actionForm(title, fields, button, onSubmit) {
  const err = h('p', { class: 'error', role: 'alert' });
  const btn = h('button', { type: 'submit', class: 'primary' }, button);
  const id = `act-${title.toLowerCase().replace(/[^a-z]+/g, '-')}`;
  const form = h('form', { class: 'action', id, 'aria-labelledby': `${id}-title` },
    h('h3', { id: `${id}-title` }, title), h('div', { class: 'fields' }, fields, h('div', { class: 'end' }, btn)), err);
  form.addEventListener('submit', async (e) => {
    e.preventDefault();
    await act(err, btn, onSubmit, null);
  });
  return form;
}

/** A duration in seconds as the CLI takes it: 90 -> "90s", 3600 -> "1h". */
function fmtEvery(s) {
  for (const [unit, n] of [['d', 86400], ['h', 3600], ['m', 60]]) if (s % n === 0) return `${s / n}${unit}`;
  return `${s}s`;
}

/** "every 1h, keep 24" (and "late" when a run is overdue), or "–". */
function scheduleShort(x) {
  if (!x) return '–';
  const late = x.lag_s > Math.max(60, x.every_s / 10) ? ` (late ${fmtAge(x.lag_s)})` : '';
  return `every ${fmtEvery(x.every_s)}, keep ${x.keep}${late}${x.last_error ? ' (failing)' : ''}`;
}

/** Seconds from "90", "90s", "15m", "1h", "2d". */
function parseEvery(text) {
  const m = /^\s*(\d+)\s*([smhd]?)\s*$/i.exec(text);
  if (!m) throw new Error(`"${text}" is not a duration (e.g. 15m, 1h, 1d)`);
  return Number(m[1]) * { '': 1, s: 1, m: 60, h: 3600, d: 86400 }[m[2].toLowerCase()];
}

/** A volume's QoS limits in words ("none" when unlimited). */
function qosText(q) {
  const parts = Object.entries(q || {}).filter(([, v]) => v !== null && v !== undefined)
    .map(([k, v]) => `${k.replace('_mbps', ' MiB/s').replace('_iops', ' IOPS')} ${fmtNum(v)}`);
  return parts.length ? parts.join(', ') : 'none';
}

async function pageVolume(main, name) {
  let d;
  try {
    d = await api('GET', `/volumes/${seg(name)}`);
  } catch (e) {
    append(main, [h('h1', {}, 'Volume'), h('p', { class: 'error', role: 'alert' }, e.message), h('a', { href: '#/volumes' }, 'All volumes')]);
    return;
  }
  const s = await loadServer();
  // The listing, not the volume's own route: that answers 404 when there is no schedule,
  // which the browser would log as an error.
  const sched = (await api('GET', '/schedules')).find((x) => x.volume === d.name) || null;
  const reload = async (message) => { if (message) toast(message); render(); };
  const written = d.mapped_blocks * 4096;
  const reduction = d.physical_bytes ? written / d.physical_bytes : 1;
  const figures = h('section', { class: 'card', 'aria-label': 'Space' },
    h('h2', {}, 'Space'),
    h('div', { class: 'figures' },
      figure('Size', fmtBytes(d.size_bytes), `${fmtNum(d.blocks)} blocks of 4 KiB`),
      figure('Written', fmtBytes(written), `${fmtNum(d.mapped_blocks)} blocks mapped`),
      figure('Unique', fmtBytes(d.exclusive_blocks * 4096), `${fmtNum(d.exclusive_blocks)} blocks; ${fmtBytes(d.exclusive_physical_bytes)} stored`),
      figure('Shared', fmtBytes(d.shared_blocks * 4096), `${fmtNum(d.shared_blocks)} blocks; ${fmtBytes(d.shared_physical_bytes)} stored`),
      figure('Physical', fmtBytes(d.physical_bytes), `${fmtNum(d.distinct_chunks)} distinct chunks`),
      figure('Reduction', ratio(reduction), 'written ÷ physical'),
      figure('To be zeroed', fmtBytes(d.tbz_blocks * 4096), `${fmtNum(d.tbz_blocks)} blocks`),
      figure('Reserved', fmtBytes(d.reserved_bytes), d.format),
      figure('Created', fmtTime(d.created_unix_s)),
      figure('QoS limits', qosText(d.qos), 'ibid volume qos'),
      figure('QoS waits', `${fmtNum(d.qos_throttled_requests)} requests`, `${fmtNum(d.qos_throttled_seconds, 2)} s`)));

  const lun = d.lun;
  const conn = h('section', { class: 'card', 'aria-label': 'Connect' },
    h('h2', {}, 'Connect'),
    h('dl', { class: 'hints' },
      h('dt', {}, 'NBD'), h('dd', {}, h('code', { id: 'nbd-url' }, `nbd://${nbdHost()}/${d.name}`)),
      h('dt', {}, 'iSCSI LUN'), h('dd', { id: 'volume-lun' }, lun == null ? 'none (every LUN is taken)' : fmtNum(lun)),
      s.iscsi && lun != null ? [h('dt', {}, 'iSCSI'), h('dd', {}, h('code', {}, `iscsi://${iscsiPortal()}/${s.iqn}/${lun}`), ` (target ${s.iqn}, LUN ${lun})`)] : null,
      s.iscsi ? null : [h('dt', {}, 'iSCSI'), h('dd', {}, 'the server runs no iSCSI target')],
      h('dt', {}, 'Clients'),
      h('dd', {}, d.clients.length ? h('ul', { class: 'plain' }, d.clients.map((c) => h('li', {}, `${c.protocol} ${c.remote}${c.initiator ? ` (${c.initiator})` : ''}${c.export && c.export !== d.name ? ` on ${c.export}` : ''}`))) : 'none connected')));

  const snapRows = d.snapshots.map((sn) => h('tr', { 'data-snapshot': sn.name },
    h('th', { scope: 'row' }, sn.name),
    h('td', {}, fmtTime(sn.created_unix_s)),
    h('td', { class: 'num' }, fmtBytes(sn.mapped_blocks * 4096)),
    h('td', {}, h('code', {}, `nbd://${nbdHost()}/${d.name}@${sn.name}`)),
    h('td', { class: 'num', 'data-col': 'lun' }, sn.lun == null ? '–' : `${fmtNum(sn.lun)} (read-only)`),
    h('td', {}, h('button', {
      type: 'button', class: 'small', 'aria-label': sn.lun == null ? `Export snapshot ${sn.name} as an iSCSI LUN` : `Stop exporting snapshot ${sn.name} (LUN ${sn.lun})`,
      onclick: async () => {
        try {
          if (sn.lun == null) {
            const r = await api('POST', `/volumes/${seg(d.name)}/snapshots/${seg(sn.name)}/export`, {});
            reload(`Exported ${d.name}@${sn.name} read-only as LUN ${r.lun}`);
          } else {
            await api('DELETE', `/volumes/${seg(d.name)}/snapshots/${seg(sn.name)}/export`);
            reload(`LUN ${sn.lun} (${d.name}@${sn.name}) removed`);
          }
        } catch (e) { toast(e.message); }
      },
    }, sn.lun == null ? 'Export LUN' : 'Unexport'), ' ', h('button', {
      type: 'button', class: 'danger small', 'aria-label': `Delete snapshot ${sn.name}`,
      onclick: async () => {
        const ok = await confirmAction({
          title: `Delete snapshot ${d.name}@${sn.name}?`,
          body: [h('p', {}, `Its point-in-time image of ${d.name} (${fmtBytes(sn.mapped_blocks * 4096)} written) will be lost; space only it holds comes back. Clones made from it are not affected.`)],
          expect: sn.name,
          ok: 'Delete snapshot',
        });
        if (!ok) return;
        try {
          await api('DELETE', `/volumes/${seg(d.name)}/snapshots/${seg(sn.name)}`);
          reload(`Deleted snapshot ${d.name}@${sn.name}`);
        } catch (e) { toast(e.message); }
      },
    }, 'Delete'))));
  const snaps = h('section', { class: 'card', 'aria-label': 'Snapshots' },
    h('h2', {}, `Snapshots (${d.snapshots.length})`),
    d.snapshots.length ? h('div', { class: 'scroll' }, h('table', { id: 'snapshots-table' },
      h('thead', {}, h('tr', {}, ['Name', 'Created', 'Written', 'NBD (read-only)', 'iSCSI LUN', ''].map((t) => h('th', { scope: 'col' }, t)))),
      h('tbody', {}, snapRows))) : h('p', { class: 'muted' }, 'No snapshots.'));

  const schedCard = h('section', { class: 'card', 'aria-label': 'Snapshot schedule', id: 'schedule' },
    h('h2', {}, 'Snapshot schedule'),
    sched ? h('dl', { class: 'hints' },
      h('dt', {}, 'Every'), h('dd', { id: 'schedule-every' }, `${fmtEvery(sched.every_s)} (keeps ${sched.keep} snapshots${sched.remote ? `; pushed to ${sched.remote}, ${sched.keep_remote ?? 'all'} kept there` : ''})`),
      h('dt', {}, 'Last run'), h('dd', { id: 'schedule-last' }, sched.last_run_unix_s ? fmtTime(sched.last_run_unix_s) : 'not since the server started'),
      h('dt', {}, 'Next run'), h('dd', { id: 'schedule-next' }, fmtTime(sched.next_run_unix_s)),
      h('dt', {}, 'Lag'), h('dd', { id: 'schedule-lag' }, sched.lag_s ? `${fmtAge(sched.lag_s)} late` : 'on time'),
      h('dt', {}, 'Runs'), h('dd', {}, `${fmtNum(sched.runs)} since the server started`),
      sched.last_error ? [h('dt', {}, 'Last error'), h('dd', { class: 'error' }, sched.last_error)] : null,
      sched.push_retry_snapshot ? [h('dt', {}, 'Push retry'), h('dd', { id: 'schedule-retry' }, `${sched.push_retry_snapshot} at ${fmtTime(sched.push_retry_unix_s)}`)] : null)
      : h('p', { class: 'muted', id: 'schedule-none' }, 'No schedule: snapshots are taken only when asked.'));

  // Actions
  const snapName = h('input', { id: 'snap-name', required: true, autocomplete: 'off' });
  const cloneName = h('input', { id: 'clone-name', required: true, autocomplete: 'off' });
  const cloneSource = h('select', { id: 'clone-source' }, h('option', { value: '' }, `${d.name} (live)`), d.snapshots.map((sn) => h('option', { value: sn.name }, `${d.name}@${sn.name}`)));
  const cloneFull = h('input', { id: 'clone-full', type: 'checkbox' });
  const resizeTo = h('input', { id: 'resize-size', required: true, value: fmtBytes(d.size_bytes).replace(/ (.)iB$/, '$1').replace(' B', '') });
  const formatTo = h('select', { id: 'format-to' }, FORMATS.map((f) => h('option', { value: f, selected: f === d.format }, f)));
  const copySource = h('input', { id: 'copy-source', required: true, placeholder: 'volume or volume@snapshot', autocomplete: 'off' });
  const copySrcOff = h('input', { id: 'copy-source-offset', value: '0' });
  const copyOff = h('input', { id: 'copy-offset', value: '0' });
  const copyLen = h('input', { id: 'copy-length', placeholder: 'whole source' });
  const lunTo = h('input', { id: 'lun-to', required: true, inputmode: 'numeric', value: lun == null ? '' : String(lun) });
  const schedEvery = h('input', { id: 'schedule-every-input', required: true, placeholder: 'e.g. 1h', value: sched ? fmtEvery(sched.every_s) : '1h' });
  const schedKeep = h('input', { id: 'schedule-keep-input', required: true, inputmode: 'numeric', value: sched ? String(sched.keep) : '24' });
  const actions = h('section', { class: 'card actions', 'aria-label': 'Actions' },
    h('h2', {}, 'Actions'),
    actionForm('Snapshot', [field('snap-name', 'Snapshot name', snapName)], 'Take snapshot', async () => {
      const sn = await api('POST', `/volumes/${seg(d.name)}/snapshots`, { name: snapName.value.trim() });
      reload(`Took snapshot ${sn.volume}@${sn.name}`);
    }),
    actionForm('Clone', [field('clone-name', 'New volume', cloneName), field('clone-source', 'Source', cloneSource),
      h('div', { class: 'check' }, cloneFull, h('label', { for: 'clone-full' }, 'Full clone (refers to no other volume; copies the map)'))], 'Clone', async () => {
      const body = { name: cloneName.value.trim(), full: cloneFull.checked };
      if (cloneSource.value) body.snapshot = cloneSource.value;
      const v = await api('POST', `/volumes/${seg(d.name)}/clone`, body);
      toast(`Cloned to ${v.name}`);
      location.hash = `#/volumes/${seg(v.name)}`;
    }),
    actionForm('Resize', [field('resize-size', 'New size', resizeTo)], 'Resize', async () => {
      await api('POST', `/volumes/${seg(d.name)}/resize`, { size: resizeTo.value.trim() });
      reload(`Resized ${d.name}`);
    }),
    actionForm('Format', [field('format-to', 'Convert to (inflate, eager-zero, back to thin)', formatTo)], 'Convert', async () => {
      const v = await api('POST', `/volumes/${seg(d.name)}/format`, { format: formatTo.value });
      reload(`${v.name} is now ${v.format}`);
    }),
    actionForm('Schedule', [field('schedule-every-input', 'Snapshot every (s, m, h, d)', schedEvery), field('schedule-keep-input', 'Keep', schedKeep)],
      sched ? 'Change schedule' : 'Set schedule', async () => {
        const keep = Number(schedKeep.value.trim());
        const body = { every_s: parseEvery(schedEvery.value), keep };
        if (sched && sched.remote) { body.remote = sched.remote; if (sched.keep_remote != null) body.keep_remote = sched.keep_remote; }
        const r = await api('PUT', `/volumes/${seg(d.name)}/schedule`, body);
        reload(`${d.name}: a snapshot every ${fmtEvery(r.every_s)}, ${r.keep} kept`);
      }),
    sched ? h('div', { class: 'action' }, h('button', {
      type: 'button', id: 'schedule-remove', class: 'small',
      onclick: async () => {
        try { await api('DELETE', `/volumes/${seg(d.name)}/schedule`); reload(`${d.name} has no schedule now`); } catch (e) { toast(e.message); }
      },
    }, 'Remove schedule')) : null,
    actionForm('iSCSI LUN', [field('lun-to', 'Move to LUN', lunTo)], 'Change LUN', async () => {
      const v = await api('PATCH', `/volumes/${seg(d.name)}`, { lun: Number(lunTo.value.trim()) });
      reload(`${v.name} is LUN ${v.lun} now`);
    }),
    actionForm('Range copy', [field('copy-source', 'Source', copySource), field('copy-source-offset', 'Source offset', copySrcOff),
      field('copy-offset', `Offset in ${d.name}`, copyOff), field('copy-length', 'Length', copyLen)], 'Copy', async () => {
      const body = { source: copySource.value.trim(), source_offset: copySrcOff.value.trim() || '0', offset: copyOff.value.trim() || '0' };
      if (copyLen.value.trim()) body.length = copyLen.value.trim();
      const r = await api('POST', `/volumes/${seg(d.name)}/copy`, body);
      reload(`Copied ${fmtBytes(r.length)} in ${fmtNum(r.seconds, 3)} s (${fmtBytes(r.shared_bytes)} shared, ${fmtBytes(r.data_bytes)} copied)`);
    }));

  const delErr = h('p', { class: 'error', role: 'alert' });
  const delBtn = h('button', { type: 'button', class: 'danger', id: 'delete-volume' }, `Delete ${d.name}…`);
  delBtn.addEventListener('click', async () => {
    const lost = [h('p', {}, 'This will be lost for good:'), h('ul', {},
      h('li', {}, `volume ${d.name}: ${fmtBytes(d.size_bytes)}, ${fmtBytes(written)} written (${fmtBytes(d.exclusive_physical_bytes)} stored only here)`),
      d.snapshots.length ? h('li', {}, `its ${d.snapshots.length} snapshot${d.snapshots.length === 1 ? '' : 's'}: ${d.snapshots.slice(0, 10).map((x) => x.name).join(', ')}${d.snapshots.length > 10 ? `, and ${d.snapshots.length - 10} more` : ''}`) : null,
      d.clients.length ? h('li', { class: 'error' }, `${d.clients.length} connected client${d.clients.length === 1 ? '' : 's'} (${d.clients.map((c) => `${c.protocol} ${c.remote}`).join(', ')}): their I/O will fail`) : null),
    h('p', { class: 'muted' }, 'Clones made from it are not affected.')];
    const ok = await confirmAction({ title: `Delete volume ${d.name}?`, body: lost, expect: d.name, ok: 'Delete volume' });
    if (!ok) return;
    const done = await act(delErr, delBtn, () => api('DELETE', `/volumes/${seg(d.name)}${d.clients.length ? '?force=true' : ''}`), `Deleted volume ${d.name}`);
    if (done !== undefined) location.hash = '#/volumes';
  });
  const danger = h('section', { class: 'card', 'aria-label': 'Delete' }, h('h2', {}, 'Delete'), delBtn, delErr);

  append(main, [
    h('p', {}, h('a', { href: '#/volumes' }, '← All volumes')),
    h('h1', {}, `Volume ${d.name}`),
    h('p', { class: 'muted' }, `${d.format}, ${fmtBytes(d.size_bytes)}, id ${d.id}`),
    figures,
    chartsBlock('vol', 'Performance'),
    conn,
    snaps,
    schedCard,
    actions,
    danger,
  ]);
  const drawPerf = async () => drawCharts('vol', await api('GET', `/stats/history?volume=${seg(d.name)}`));
  await drawPerf();
  every(POLL_MS * 2, () => drawPerf().catch(() => {}));
}

// Pool settings

async function pagePool(main) {
  // The Pool page shows every figure: exact when it opens.
  await refreshPool(true);
  const p = state.pool;
  if (!p) {
    append(main, [h('h1', {}, 'Pool'), h('p', { class: 'error' }, state.poolError || 'not available')]);
    return;
  }
  const cap = h('input', { id: 'pool-capacity', placeholder: fmtBytes(p.capacity_bytes) });
  const force = h('input', { id: 'pool-force', type: 'checkbox' });
  const soft = h('input', { id: 'pool-soft', type: 'number', min: 1, max: 100, value: p.soft_threshold_pct });
  const settings = actionForm('Settings', [
    field('pool-capacity', `Capacity (now ${fmtBytes(p.capacity_bytes)})`, cap),
    field('pool-soft', 'Soft threshold (%)', soft),
    h('div', { class: 'check' }, force, h('label', { for: 'pool-force' }, 'Allow more than the filesystem holds')),
  ], 'Save', async () => {
    const body = { soft_threshold_pct: Number(soft.value) };
    if (cap.value.trim()) { body.capacity = cap.value.trim(); body.force = force.checked; }
    state.pool = await api('PATCH', '/pool', body);
    renderHealth();
    toast('Pool settings saved');
    render();
  });
  // The breakdown's figures as rows of their own ("breakdown unique physical bytes", ...).
  const flat = Object.entries(p).flatMap(([k, v]) => (v && typeof v === 'object'
    ? Object.entries(v).map(([k2, v2]) => [`${k}_${k2}`, v2 ?? '–'])
    : [[k, v ?? '–']]));
  const rows = flat.map(([k, v]) => h('tr', {}, h('th', { scope: 'row' }, k.replace(/_/g, ' ')),
    h('td', { class: 'num' }, k.endsWith('_bytes') && typeof v === 'number' ? `${fmtBytes(v)}` : typeof v === 'number' ? fmtNum(v, 3) : String(v)),
    h('td', { class: 'num muted' }, k.endsWith('_bytes') && typeof v === 'number' ? fmtNum(v) : '')));
  const s = state.scrub;
  const scrubErr = h('p', { class: 'error', role: 'alert' });
  const scrubBtn = h('button', { type: 'button' }, 'Scrub now');
  scrubBtn.addEventListener('click', () => act(scrubErr, scrubBtn, async () => { await api('POST', '/pool/scrub'); await refreshPool(); render(); }, 'Scrub started'));
  const scrub = h('section', { class: 'card', 'aria-label': 'Scrub' }, h('h2', {}, 'Background scrub'),
    s ? h('p', {}, `${s.running ? 'Running' : 'Idle'}; ${fmtNum(s.passes)} passes since start; last pass finished ${fmtTime(s.last_pass_finished_unix_s)}; ${fmtNum(s.damaged_total)} damaged chunks found; reads at most ${fmtBytes(s.rate_bytes_per_s)}/s.`) : null,
    s && s.damaged.length ? h('ul', {}, s.damaged.map((x) => h('li', { class: 'error' }, JSON.stringify(x)))) : null,
    scrubBtn, scrubErr);
  append(main, [
    h('h1', {}, 'Pool'),
    h('section', { class: 'card' }, settings),
    scrub,
    h('section', { class: 'card', 'aria-label': 'Figures' }, h('h2', {}, 'Where every byte went'),
      h('div', { class: 'scroll' }, h('table', { class: 'figures-table' }, h('tbody', {}, rows)))),
  ]);
}

// ---------- Router ----------

async function render() {
  stopPage();
  // A page still loading when the next one starts builds into a detached element.
  const main = h('div', { class: 'page' });
  clear($('#main')).append(main);
  const hash = location.hash.replace(/^#/, '') || '/';
  const parts = hash.split('/').filter(Boolean);
  const page = parts[0] || 'overview';
  for (const a of document.querySelectorAll('nav a')) {
    if (a.dataset.nav === page) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
  const token = {};
  state.page = token;
  delete $('#main').dataset.ready;
  delete $('#main').dataset.route;
  try {
    if (page === 'volumes' && parts[1]) {
      document.title = `${decodeURIComponent(parts[1])} · ibid`;
      await pageVolume(main, decodeURIComponent(parts[1]));
    } else if (page === 'volumes') {
      document.title = 'Volumes · ibid';
      await pageVolumes(main);
    } else if (page === 'pool') {
      document.title = 'Pool · ibid';
      await pagePool(main);
    } else {
      document.title = 'ibid';
      await pageOverview(main);
    }
  } catch (e) {
    if (state.page === token && e.status !== 401) append(main, [h('p', { class: 'error', role: 'alert' }, e.message)]);
  }
  if (state.page === token) {
    $('#main').dataset.ready = page;
    $('#main').dataset.route = hash;
    // When the page showed its data, for measurements (tests/web.rs).
    performance.mark(`ibid-ready ${hash}`);
  }
}

async function start() {
  initLogin();
  $('#sign-out').hidden = !state.token;
  $('#sign-out').addEventListener('click', () => {
    sessionStorage.removeItem(TOKEN_KEY);
    state.token = '';
    location.reload();
  });
  // The skip link moves the focus; it must not change the route.
  $('.skip').addEventListener('click', (e) => { e.preventDefault(); $('#main').focus(); });
  window.addEventListener('hashchange', () => { render(); $('#main').focus(); });
  await refreshPool();
  setInterval(refreshPool, POOL_POLL_MS);
  if (!loginOpen) await render();
}

start();
