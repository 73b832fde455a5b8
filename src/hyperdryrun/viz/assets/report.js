/* HyperDryRun memory report: draws the data embedded in #hdr-data with uPlot. No network, no dependencies. */
(function () {
  'use strict';
  const D = JSON.parse(document.getElementById('hdr-data').textContent);
  const GIB = 2 ** 30;
  const MIB = 2 ** 20;
  const CATS = D.categories;
  const PHASE_COLOR = Object.fromEntries(D.phases.map(p => [p.name, p.color]));
  const nf2 = new Intl.NumberFormat('en-US', {minimumFractionDigits: 2, maximumFractionDigits: 2});
  const nfInt = new Intl.NumberFormat('en-US');
  const hdr = (window.hdr = {data: D, side: 0, timeline: null, overview: null, peakMarker: null, ready: false});

  // ------------------------------------------------------------------ helpers
  function fmtBytes(n) {
    if (n == null) return '';
    return Math.abs(n) >= GIB / 10 ? nf2.format(n / GIB) + ' GiB' : nf2.format(n / MIB) + ' MiB';
  }
  function unitFor(max) {
    return max >= GIB / 10 ? ['GiB', GIB] : ['MiB', MIB];
  }
  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v == null || v === false) continue;
      if (k === 'text') e.textContent = v;
      else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? '' : v);
    }
    for (const kid of kids.flat()) if (kid != null) e.append(kid);
    return e;
  }
  function swatch(color) {
    return el('span', {class: 'swatch', style: `background:${color}`});
  }
  /** Change points [[task...], [value...]] -> one value per task, 0..n (the last repeated at n). */
  function expand(cp, n) {
    const out = new Array(n + 1);
    const T = cp[0], V = cp[1];
    let k = 0, cur = 0;
    for (let t = 0; t < n; t++) {
      while (k < T.length && T[k] <= t) cur = V[k++];
      out[t] = cur;
    }
    out[n] = n > 0 ? out[n - 1] : 0;
    return out;
  }
  function byteIncrs(div) {
    const steps = [0.01, 0.02, 0.05, 0.1, 0.2, 0.25, 0.5, 1, 2, 2.5, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000];
    return steps.map(s => s * div);
  }
  function fmtAxis(v, div) {
    const x = v / div;
    return Math.abs(x) >= 100 || Number.isInteger(x) ? nfInt.format(Math.round(x)) : String(+x.toFixed(2));
  }
  function chartWidth(host) {
    return Math.max(320, host.clientWidth || host.parentElement.clientWidth - 36);
  }
  const stepped = uPlot.paths.stepped({align: 1});
  const resizers = [];
  window.addEventListener('resize', () => resizers.forEach(f => f()));

  // ------------------------------------------------------------------ a sortable, filterable table
  /**
   * columns: [{label, num, get(row) -> sort value, show(row) -> text or Node}]; rows: any.
   * opts: {sort: column index, desc, filter(row) -> searchable text, categories(row) -> name, detail(row) -> Node,
   *        limit, placeholder, count(rows) -> text}
   */
  function dataTable(host, columns, rows, opts) {
    host.replaceChildren();
    let sortCol = opts.sort ?? -1;
    let desc = opts.desc ?? false;
    let limit = opts.limit ?? Infinity;
    let query = '';
    let cat = '';
    const open = new Set();
    const box = el('div', {class: 'tablebox'});
    const controls = el('div', {class: 'controls'});
    const count = el('span', {class: 'count'});
    if (opts.filter) {
      controls.append(
        el('input', {
          type: 'search', placeholder: opts.placeholder || 'filter', 'aria-label': 'filter rows',
          oninput: e => { query = e.target.value.trim().toLowerCase(); draw(); },
        }),
      );
    }
    if (opts.categories) {
      const sel = el('select', {'aria-label': 'category', onchange: e => { cat = e.target.value; draw(); }},
        el('option', {value: '', text: 'all categories'}),
        CATS.map(c => el('option', {value: c.name, text: c.name})));
      controls.append(sel);
    }
    controls.append(count);
    const thead = el('thead');
    const tbody = el('tbody');
    const table = el('table', {}, thead, tbody);
    const more = el('div', {class: 'more'});
    box.append(controls, el('div', {class: 'scroll'}, table), more);
    host.append(box);
    const ths = columns.map((c, i) =>
      el('th', {
        class: (c.num ? 'num ' : '') + (c.get ? 'sortable' : ''), scope: 'col', text: c.label,
        onclick: c.get ? () => { desc = sortCol === i ? !desc : !!c.num; sortCol = i; draw(); } : null,
      }));
    thead.append(el('tr', {}, ths));
    const text = opts.filter ? rows.map(r => opts.filter(r).toLowerCase()) : null;

    function draw() {
      let idx = rows.map((_, i) => i);
      if (query) idx = idx.filter(i => text[i].includes(query));
      if (cat) idx = idx.filter(i => opts.categories(rows[i]) === cat);
      if (sortCol >= 0) {
        const g = columns[sortCol].get;
        idx.sort((a, b) => {
          const x = g(rows[a]), y = g(rows[b]);
          const c = x < y ? -1 : x > y ? 1 : 0;
          return (desc ? -c : c) || a - b;
        });
      }
      ths.forEach((th, i) => {
        if (i === sortCol) th.setAttribute('aria-sort', desc ? 'descending' : 'ascending');
        else th.removeAttribute('aria-sort');
      });
      const shown = idx.slice(0, limit);
      const frag = document.createDocumentFragment();
      for (const i of shown) {
        const r = rows[i];
        const tr = el('tr', {class: 'row' + (open.has(i) ? ' open' : ''), 'data-row': i},
          columns.map(c => el('td', {class: (c.num ? 'num ' : '') + (c.cls || '')}, c.show(r))));
        frag.append(tr);
        if (opts.detail) {
          tr.addEventListener('click', () => { open.has(i) ? open.delete(i) : open.add(i); draw(); });
          if (open.has(i)) frag.append(el('tr', {class: 'detail'}, el('td', {colspan: columns.length}, opts.detail(r))));
        } else if (opts.onclick) {
          tr.addEventListener('click', () => opts.onclick(r));
        }
      }
      tbody.replaceChildren(frag);
      count.textContent = opts.count ? opts.count(idx.map(i => rows[i]), rows) : `${nfInt.format(idx.length)} rows`;
      more.replaceChildren();
      if (idx.length > shown.length) {
        more.append(el('button', {class: 'link', text: `show all ${nfInt.format(idx.length)} rows`,
          onclick: () => { limit = Infinity; draw(); }}));
      }
    }
    draw();
    return {draw};
  }

  // ------------------------------------------------------------------ per-side data
  function str(side, i) {
    return i < 0 ? '' : side.strings[i];
  }
  function frames(side, b) {
    const st = side.stacks[side.blocks.stack[b]] || [];
    return st.map(([f, line, fn]) => ({file: str(side, f), line, fn: str(side, fn)}));
  }
  function blockRows(side, task) {
    const B = side.blocks;
    const rows = [];
    for (let i = 0; i < B.size.length; i++) {
      if (task == null || (B.start[i] <= task && (B.end[i] < 0 || task < B.end[i]))) rows.push(i);
    }
    return rows;
  }
  function where(side, b) {
    const f = frames(side, b)[0];
    return f ? `${f.file.split('/').pop()}:${f.line}` : '';
  }

  // ------------------------------------------------------------------ sections
  function keptText(bd) {
    const kept = CATS.filter(c => bd[c.name]).sort((a, b) => bd[b.name] - bd[a.name]).slice(0, 3);
    return kept.length ? kept.map(c => c.name.toLowerCase()).join(', ') : 'nothing kept';
  }

  function renderHeadline(side) {
    const s = side.summary;
    const host = document.getElementById('headline');
    const stats = [
      ['Peak', fmtBytes(s.peak_bytes), `in ${s.peak_phase} · task ${s.peak_task} · ${s.peak_op}`, ''],
      ['After the step', fmtBytes(s.current_bytes), keptText(s.breakdown_after_step || {}), ''],
      ['Blocks', nfInt.format(s.num_blocks), `${nfInt.format(s.num_tasks)} tasks`, ''],
    ];
    if (s.capacity_bytes != null) {
      stats.push([s.oom ? 'Does not fit' : s.at_risk ? 'At risk' : 'Fits',
        `${+(s.capacity_bytes / GIB).toFixed(2)} GiB`,
        s.oom ? `over by ${fmtBytes(-s.headroom_bytes)}`
          : `${fmtBytes(s.headroom_bytes)} headroom` + (s.at_risk ? `, within the ${fmtBytes(s.margin_bytes)} margin` : ''),
        s.oom || s.at_risk ? 'bad' : 'good']);
    }
    host.replaceChildren(...stats.map(([label, value, sub, cls]) =>
      el('div', {class: 'stat ' + cls}, el('div', {class: 'label', text: label}),
        el('div', {class: 'value', text: value}), el('div', {class: 'sub', text: sub}))));
    const bd = s.breakdown_at_peak;
    const total = s.peak_bytes || 1;
    const bar = el('div', {class: 'stackbar', role: 'img', 'aria-label': 'what the peak consists of'},
      CATS.filter(c => bd[c.name]).map(c =>
        el('span', {style: `width:${(100 * bd[c.name]) / total}%;background:${c.color}`,
          title: `${c.name}: ${fmtBytes(bd[c.name])}`})));
    const legend = el('div', {class: 'legend-row'}, CATS.filter(c => bd[c.name]).map(c =>
      el('span', {}, swatch(c.color), `${c.name} ${fmtBytes(bd[c.name])} (${(100 * bd[c.name] / total).toFixed(1)}%)`)));
    document.getElementById('breakdown').replaceChildren(
      el('div', {class: 'hint', text: 'At the peak'}), bar, legend);
  }

  function phaseBandsHook(spans) {
    return u => {
      const ctx = u.ctx;
      const {left, top, width, height} = u.bbox;
      ctx.save();
      ctx.beginPath();
      ctx.rect(left, top, width, height);
      ctx.clip();
      ctx.font = `${12 * devicePixelRatio}px system-ui, sans-serif`;
      ctx.textAlign = 'center';
      ctx.textBaseline = 'top';
      for (const [name, s, e] of spans) {
        const x0 = u.valToPos(s, 'x', true);
        const x1 = u.valToPos(e, 'x', true);
        if (x1 < left || x0 > left + width) continue;
        ctx.fillStyle = PHASE_COLOR[name] || '#f4f4f4';
        ctx.fillRect(x0, top, x1 - x0, height);
        if (x1 - x0 > 70 * devicePixelRatio) {
          ctx.fillStyle = '#5d6878';
          ctx.fillText(name, (Math.max(x0, left) + Math.min(x1, left + width)) / 2, top + 4 * devicePixelRatio);
        }
      }
      ctx.restore();
    };
  }

  function markerHook(side, getSelected) {
    return u => {
      const s = side.summary;
      const ctx = u.ctx;
      const dpr = devicePixelRatio;
      const {left, top, width, height} = u.bbox;
      ctx.save();
      ctx.beginPath();
      ctx.rect(left, top - 14 * dpr, width, height + 14 * dpr);
      ctx.clip();
      const sel = getSelected();
      if (sel != null && sel !== s.peak_task) {
        const sx = u.valToPos(sel + 0.5, 'x', true);
        ctx.strokeStyle = D.selectColor;
        ctx.lineWidth = 1.5 * dpr;
        ctx.beginPath();
        ctx.moveTo(sx, top);
        ctx.lineTo(sx, top + height);
        ctx.stroke();
      }
      const cx = Math.round(u.valToPos(s.peak_task + 0.5, 'x', true));
      const cy = Math.round(u.valToPos(s.peak_bytes, 'y', true));
      ctx.setLineDash([3 * dpr, 3 * dpr]);
      ctx.strokeStyle = D.peakColor;
      ctx.lineWidth = dpr;
      ctx.beginPath();
      ctx.moveTo(cx, cy);
      ctx.lineTo(cx, top + height);
      ctx.stroke();
      ctx.setLineDash([]);
      ctx.fillStyle = D.peakColor;
      ctx.strokeStyle = '#ffffff';
      ctx.lineWidth = 2 * dpr;
      ctx.beginPath();
      ctx.arc(cx, cy, 6 * dpr, 0, 2 * Math.PI);
      ctx.stroke();
      ctx.fill();
      const label = `peak ${fmtBytes(s.peak_bytes)} · task ${s.peak_task}`;
      ctx.font = `600 ${12 * dpr}px system-ui, sans-serif`;
      const w = ctx.measureText(label).width;
      const right = cx + 12 * dpr + w < left + width;
      ctx.textAlign = right ? 'left' : 'right';
      ctx.textBaseline = 'middle';
      const tx = right ? cx + 12 * dpr : cx - 12 * dpr;
      const ty = Math.max(top + 10 * dpr, cy);
      ctx.fillStyle = 'rgba(255,255,255,0.85)';
      ctx.fillRect(right ? tx - 3 * dpr : tx - w - 3 * dpr, ty - 9 * dpr, w + 6 * dpr, 18 * dpr);
      ctx.fillStyle = D.peakColor;
      ctx.fillText(label, tx, ty);
      ctx.restore();
      hdr.peakMarker = {task: s.peak_task, bytes: s.peak_bytes, canvasX: cx, canvasY: cy};
    };
  }

  let selectedTask = null;

  function renderTimeline(side) {
    const host = document.getElementById('timeline');
    if (hdr.timeline) { hdr.timeline.destroy(); hdr.timeline = null; }
    host.replaceChildren();
    const tl = side.timeline;
    document.getElementById('timeline-card').hidden = !tl;
    if (!tl) return;
    const n = tl.n;
    const x = Array.from({length: n + 1}, (_, i) => i);
    const raw = CATS.map(c => expand(tl.cats[c.name], n));
    const cum = [];
    let acc = new Array(n + 1).fill(0);
    for (const r of raw) { acc = acc.map((v, i) => v + r[i]); cum.push(acc); }
    const extraNames = Object.keys(tl.series || {});
    const extras = extraNames.map(k => expand(tl.series[k], n));
    const top = Math.max(side.summary.peak_bytes, ...extras.map(e => Math.max(...e)));
    const [unit, div] = unitFor(top);
    const taskLabel = i => {
      if (i == null || i >= n) return '';
      return `task ${i} · ${str(side, tl.taskOp[i])} · ${D.phases[tl.taskPhase[i]].name} · ${fmtBytes(cum[cum.length - 1][i])}`;
    };
    const series = [{label: 'task', value: (u, v, si, i) => taskLabel(i)}];
    CATS.forEach((c, k) => series.push({
      label: c.name, stroke: c.color, fill: c.color + 'e6', width: 0, paths: stepped, points: {show: false},
      value: (u, v, si, i) => (i == null ? '' : fmtBytes(raw[k][i])),
    }));
    const data = [x, ...cum];
    if (extras.length) {
      series.push({label: 'allocated', stroke: '#1d2430', width: 1, paths: stepped, points: {show: false},
        value: (u, v) => fmtBytes(v)});
      data.push(cum[cum.length - 1]);
      extraNames.forEach((name, k) => {
        series.push({label: name, stroke: D.seriesColors[name] || '#333', width: 1.6, dash: [6, 4],
          paths: stepped, points: {show: false}, value: (u, v) => fmtBytes(v)});
        data.push(extras[k]);
      });
    }
    const bands = CATS.slice(1).map((c, k) => ({series: [k + 2, k + 1], fill: c.color + 'e6'}));
    let down = null;
    const opts = {
      width: chartWidth(host), height: 380, bands, series,
      scales: {x: {time: false, range: [0, n]}, y: {range: (u, lo, hi) => [0, Math.max(top, hi) * 1.07 || 1]}},
      axes: [
        {label: 'task (operators of the step, in order)', grid: {show: false}},
        {label: `memory (${unit})`, size: 64, incrs: byteIncrs(div), values: (u, sp) => sp.map(v => fmtAxis(v, div)),
          grid: {stroke: '#e9edf2'}},
      ],
      cursor: {drag: {x: true, y: false}, points: {show: false},
        dataIdx: (u, si, closest, xv) => Math.max(0, Math.min(n - 1, Math.floor(xv)))},
      legend: {live: true},
      hooks: {
        drawClear: [phaseBandsHook(tl.spans)],
        draw: [markerHook(side, () => selectedTask)],
        ready: [u => {
          const showSelected = () => u.setLegend({idx: Math.min(selectedTask ?? side.summary.peak_task, n - 1)});
          showSelected();
          u.over.addEventListener('mouseleave', showSelected);
          u.over.addEventListener('mousedown', e => { down = e.clientX; });
          u.over.addEventListener('click', e => {
            if (down != null && Math.abs(e.clientX - down) > 3) return;
            const t = Math.floor(u.posToVal(u.cursor.left, 'x'));
            if (t >= 0 && t < n) selectTask(t, true);
          });
        }],
      },
    };
    hdr.timeline = new uPlot(opts, data, host);
  }

  function renderPhases(side) {
    const rows = Object.entries(side.phases).map(([name, p]) => ({name, ...p}));
    dataTable(document.getElementById('phases'), [
      {label: 'phase', get: r => r.name, show: r => el('span', {}, swatch(PHASE_COLOR[r.name] || '#eee'), r.name)},
      {label: 'peak', num: true, get: r => r.peak_bytes, show: r => fmtBytes(r.peak_bytes)},
      {label: 'at task', num: true, get: r => r.peak_task, show: r => String(r.peak_task)},
      {label: 'op', get: r => r.peak_op, show: r => r.peak_op, cls: 'mono'},
      {label: 'tasks', num: true, get: r => r.num_tasks, show: r => nfInt.format(r.num_tasks)},
    ], rows, {onclick: side.timeline ? r => selectTask(r.peak_task, true) : null,
      count: () => (side.timeline ? 'click a phase to list what is alive at its peak' : '')});
  }

  function renderTopModules(side) {
    const rows = side.byModule;
    const max = Math.max(1, ...rows.map(r => r.bytes));
    dataTable(document.getElementById('top-modules'), [
      {label: 'module', get: r => r.module, show: r => (r.children ? `${r.module} (${r.children})` : r.module),
        cls: 'mono'},
      {label: 'bytes at the peak', num: true, get: r => r.bytes,
        show: r => el('span', {class: 'bar'}, el('i', {style: `width:${(100 * r.bytes) / max}%`}),
          el('b', {text: fmtBytes(r.bytes)}))},
      {label: '%', num: true, get: r => r.bytes,
        show: r => (100 * r.bytes / (side.summary.peak_bytes || 1)).toFixed(1)},
      {label: 'largest', get: r => r.largest, show: r => r.largest, cls: 'mono'},
    ], rows, {sort: 1, desc: true, limit: 8, count: () => 'blocks alive at the peak, by the module that allocated them'});
  }

  function renderLiveSet(side, task) {
    const atPeak = task === side.summary.peak_task;
    const rows = blockRows(side, side.blocksScope === 'all' ? task : null);
    const B = side.blocks;
    const total = rows.reduce((a, i) => a + B.size[i], 0);
    const tl = side.timeline;
    const title = document.getElementById('liveset-title');
    title.textContent = atPeak ? `Live set at the peak (task ${task})` : `Live set at task ${task}`;
    title.dataset.task = task;
    const info = document.getElementById('liveset-info');
    const what = tl ? `${D.phases[tl.taskPhase[task]].name} · ${str(side, tl.taskOp[task])}` : side.summary.peak_op;
    info.replaceChildren(`${what} · ${fmtBytes(total)} in ${nfInt.format(rows.length)} blocks. ` +
      'Click a row for the Python stack that allocated it.');
    if (side.blocksScope !== 'all') {
      info.append(` Only the ${nfInt.format(rows.length)} largest blocks are in the JSON report (no CSV beside it).`);
    }
    if (!atPeak) {
      info.append(' ', el('button', {class: 'link', text: 'back to the peak',
        onclick: () => selectTask(side.summary.peak_task, false)}));
    }
    const catName = i => CATS[B.cat[i]].name;
    dataTable(document.getElementById('liveset'), [
      {label: 'size', num: true, get: i => B.size[i], show: i => fmtBytes(B.size[i])},
      {label: 'category', get: i => catName(i), show: i => el('span', {}, swatch(CATS[B.cat[i]].color), catName(i))},
      {label: 'op', get: i => str(side, B.op[i]), show: i => str(side, B.op[i]), cls: 'mono'},
      {label: 'module', get: i => str(side, B.module[i]), show: i => str(side, B.module[i]) || '—', cls: 'mono'},
      {label: 'phase', get: i => D.phases[B.phase[i]].name, show: i => D.phases[B.phase[i]].name},
      {label: 'allocated', num: true, get: i => B.start[i], show: i => `task ${B.start[i]}`},
      {label: 'freed', num: true, get: i => (B.end[i] < 0 ? Infinity : B.end[i]),
        show: i => (B.end[i] < 0 ? 'kept' : `task ${B.end[i]}`)},
      {label: 'allocated at', get: i => where(side, i), show: i => where(side, i) || '—', cls: 'mono'},
    ], rows, {
      sort: 0, desc: true, limit: 200, placeholder: 'filter: op, module, file, function…',
      filter: i => [str(side, B.op[i]), str(side, B.module[i]), catName(i), D.phases[B.phase[i]].name,
        ...frames(side, i).map(f => `${f.file}:${f.line} ${f.fn}`)].join(' '),
      categories: catName,
      detail: i => {
        const fr = frames(side, i);
        const stack = el('div', {class: 'stack'}, fr.length
          ? fr.map(f => el('div', {class: 'frame'}, `${f.file}:${f.line} in `, el('span', {class: 'fn', text: f.fn})))
          : el('div', {class: 'none', text: 'no Python frame of user code (allocated inside torch, e.g. by autograd)'}));
        return el('div', {}, el('div', {class: 'muted',
          text: `block ${B.id[i]} · ${nfInt.format(B.size[i])} B (${nfInt.format(B.requested[i])} B requested)`}),
        stack);
      },
      count: shown => {
        const bytes = shown.reduce((a, i) => a + B.size[i], 0);
        return `${nfInt.format(shown.length)} blocks · ${fmtBytes(bytes)}`;
      },
    });
  }

  function renderModules(side) {
    const rows = side.modules;
    document.getElementById('modules-card').hidden = !rows.length;
    if (!rows.length) return;
    const peak = side.summary.peak_bytes || 1;
    const barCell = v => el('span', {class: 'bar'}, el('i', {style: `width:${(100 * v) / peak}%`}),
      el('b', {text: fmtBytes(v)}));
    dataTable(document.getElementById('modules'), [
      {label: 'module', get: r => r[0], show: r => r[0], cls: 'mono'},
      {label: 'parameters', num: true, get: r => r[1], show: r => fmtBytes(r[1])},
      {label: 'forward peak', num: true, get: r => r[2], show: r => barCell(r[2])},
      {label: 'backward peak', num: true, get: r => r[3], show: r => barCell(r[3])},
      {label: 'held at the peak', num: true, get: r => r[4], show: r => fmtBytes(r[4])},
      {label: 'calls', num: true, get: r => r[5], show: r => String(r[5])},
    ], rows, {limit: 100, placeholder: 'filter modules', filter: r => r[0],
      count: shown => `${nfInt.format(shown.length)} modules`});
  }

  function renderLimitations(side) {
    document.getElementById('limitations-list').replaceChildren(...side.limitations.map(t => el('li', {text: t})));
  }

  // ------------------------------------------------------------------ several sides
  function renderOverview() {
    const card = document.getElementById('overview');
    if (D.sides.length < 2) return;
    card.hidden = false;
    document.getElementById('overview-title').textContent = D.compare
      ? `${D.sides[0].label} vs ${D.sides[1].label}: memory over the step` : 'Ranks: memory over the step';
    const host = document.getElementById('overview-chart');
    const drawn = D.sides.map((s, k) => [s, k]).filter(([s]) => s.timeline);
    if (drawn.length > 1) {
      const tables = drawn.map(([s]) => {
        const n = s.timeline.n;
        const scale = D.compare ? 100 / n : 1;
        return [Array.from({length: n + 1}, (_, i) => i * scale), expand(s.timeline.total, n)];
      });
      const data = uPlot.join(tables);
      const top = Math.max(...drawn.map(([s]) => s.summary.peak_bytes));
      const [unit, div] = unitFor(top);
      const series = [{label: D.compare ? 'share of the step' : 'task',
        value: (u, v) => (v == null ? '' : D.compare ? `${v.toFixed(1)}%` : `task ${v}`)}];
      drawn.forEach(([s, k]) => series.push({label: s.label, stroke: D.sideColors[k % D.sideColors.length],
        width: 1.5, paths: stepped, spanGaps: true, points: {show: false}, value: (u, v) => fmtBytes(v)}));
      const peaksHook = u => {
        const ctx = u.ctx;
        drawn.forEach(([s, k]) => {
          const scale = D.compare ? 100 / s.timeline.n : 1;
          const cx = u.valToPos((s.summary.peak_task + 0.5) * scale, 'x', true);
          const cy = u.valToPos(s.summary.peak_bytes, 'y', true);
          ctx.fillStyle = D.sideColors[k % D.sideColors.length];
          ctx.beginPath();
          ctx.arc(cx, cy, 4.5 * devicePixelRatio, 0, 2 * Math.PI);
          ctx.fill();
        });
      };
      if (hdr.overview) hdr.overview.destroy();
      hdr.overview = new uPlot({
        width: chartWidth(host), height: 280, series,
        scales: {x: {time: false}, y: {range: (u, lo, hi) => [0, Math.max(top, hi) * 1.07 || 1]}},
        axes: [{label: D.compare ? 'share of the step (%)' : 'task (operators of the step, in order)', grid: {show: false}},
          {label: `memory (${unit})`, size: 64, incrs: byteIncrs(div), values: (u, sp) => sp.map(v => fmtAxis(v, div)),
            grid: {stroke: '#e9edf2'}}],
        cursor: {points: {show: false}}, hooks: {draw: [peaksHook]},
      }, data, host);
      resizers.push(() => hdr.overview && hdr.overview.setSize({width: chartWidth(host), height: 280}));
    }
    const ref = D.sides[0].summary.peak_bytes;
    const cols = [
      {label: D.compare ? 'side' : 'rank', get: r => r.k,
        show: r => el('span', {}, swatch(D.sideColors[r.k % D.sideColors.length]), r.s.label)},
      {label: 'peak', num: true, get: r => r.s.summary.peak_bytes, show: r => fmtBytes(r.s.summary.peak_bytes)},
    ];
    if (D.compare) {
      cols.push({label: 'vs A', num: true, get: r => r.s.summary.peak_bytes - ref, show: r => {
        const d = r.s.summary.peak_bytes - ref;
        return r.k === 0 ? '—' : `${d >= 0 ? '+' : '−'}${fmtBytes(Math.abs(d))} (${ref ? (100 * d / ref).toFixed(2) : '∞'}%)`;
      }});
    }
    if (D.compare) {
      cols.push({label: 'source', get: r => r.s.source, show: r => el('span', {title: r.s.source, text: r.s.source}),
        cls: 'mono'});
    }
    cols.push(
      {label: 'phase', get: r => r.s.summary.peak_phase, show: r => r.s.summary.peak_phase},
      {label: 'task', num: true, get: r => r.s.summary.peak_task, show: r => String(r.s.summary.peak_task)},
      {label: 'op', get: r => r.s.summary.peak_op, show: r => r.s.summary.peak_op, cls: 'mono'},
      {label: 'after the step', num: true, get: r => r.s.summary.current_bytes, show: r => fmtBytes(r.s.summary.current_bytes)},
      ...CATS.map(c => ({label: c.name, num: true, get: r => r.s.summary.breakdown_at_peak[c.name] || 0,
        show: r => fmtBytes(r.s.summary.breakdown_at_peak[c.name] || 0)})),
    );
    dataTable(document.getElementById('overview-table'), cols, D.sides.map((s, k) => ({s, k})), {
      onclick: r => selectSide(r.k),
      count: () => (D.compare ? '' : `highest: ${D.sides.reduce((a, s) => (s.summary.peak_bytes > a.summary.peak_bytes ? s : a)).label} · `) +
        'click a row to show it below',
    });
  }

  // ------------------------------------------------------------------ navigation
  function selectTask(task, scroll) {
    selectedTask = task;
    const side = D.sides[hdr.side];
    renderLiveSet(side, task);
    if (hdr.timeline) hdr.timeline.redraw(false);
    if (scroll) document.getElementById('liveset-card').scrollIntoView({behavior: 'instant', block: 'start'});
  }

  function selectSide(k) {
    hdr.side = k;
    const side = D.sides[k];
    document.querySelectorAll('#side-tabs button').forEach((b, i) => b.setAttribute('aria-selected', String(i === k)));
    selectedTask = side.summary.peak_task;
    renderHeadline(side);
    renderTimeline(side);
    renderPhases(side);
    renderTopModules(side);
    renderLiveSet(side, side.summary.peak_task);
    renderModules(side);
    renderLimitations(side);
  }

  document.getElementById('title').textContent = D.title;
  const modes = [...new Set(D.sides.map(s => s.mode))];
  document.getElementById('title').append(...modes.map(m => el('span', {class: 'badge', text: m})));
  if (D.sides.length > 1) {
    document.getElementById('side-tabs').append(...D.sides.map((s, k) =>
      el('button', {role: 'tab', text: s.label, onclick: () => selectSide(k)})));
  }
  resizers.push(() => {
    const host = document.getElementById('timeline');
    if (hdr.timeline) hdr.timeline.setSize({width: chartWidth(host), height: 380});
  });
  renderOverview();
  selectSide(0);
  hdr.selectTask = selectTask;
  hdr.selectSide = selectSide;
  hdr.ready = true;
})();
