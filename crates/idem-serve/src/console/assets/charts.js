// The idem console's live charts: polls /console/metrics.json every 2 s and draws, per scope,
// the messages per second of each series as SVG lines. Built with DOM calls only (no
// innerHTML): scope names are data, never markup.
(function () {
  "use strict";
  var root = document.getElementById("charts");
  if (!root) return;
  var src = root.getAttribute("data-src");
  var SERIES = ["processed", "duplicate", "conflict", "dead_lettered"];
  var COLORS = { processed: "#2456c7", duplicate: "#6b7b93", conflict: "#c07a00", dead_lettered: "#b3261e" };
  var LABELS = { processed: "processed", duplicate: "duplicates", conflict: "conflicts", dead_lettered: "dead-lettered" };
  var KEEP = 150; // 5 minutes of samples
  var W = 600, H = 180, PAD = 28;
  var SVGNS = "http://www.w3.org/2000/svg";
  var last = null; // previous snapshot: { t, totals: { scope: { series: n } } }
  var history = {}; // scope -> [{ t, rates }]
  var charts = {}; // scope -> { svg, lines, max }

  function el(name, attrs, ns) {
    var e = ns ? document.createElementNS(SVGNS, name) : document.createElement(name);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    return e;
  }

  function chartFor(scope) {
    if (charts[scope]) return charts[scope];
    var box = el("div", { "class": "chart", "data-scope": scope });
    var h = el("h3");
    h.textContent = scope;
    box.appendChild(h);
    var svg = el("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": "messages per second of " + scope }, true);
    svg.appendChild(el("line", { x1: PAD, y1: H - PAD, x2: W, y2: H - PAD, stroke: "#dde1e7" }, true));
    var max = el("text", { x: 2, y: 12, "font-size": 11, fill: "#5d6675" }, true);
    svg.appendChild(max);
    var span = el("text", { x: W - 4, y: H - 8, "font-size": 11, fill: "#5d6675", "text-anchor": "end" }, true);
    svg.appendChild(span);
    var zero = el("text", { x: 2, y: H - PAD + 4, "font-size": 11, fill: "#5d6675" }, true);
    zero.textContent = "0";
    svg.appendChild(zero);
    var lines = {};
    SERIES.forEach(function (s) {
      lines[s] = el("polyline", { fill: "none", stroke: COLORS[s], "stroke-width": 2, "data-series": s }, true);
      svg.appendChild(lines[s]);
    });
    box.appendChild(svg);
    var legend = el("div", { "class": "legend" });
    SERIES.forEach(function (s) {
      var span = el("span", { "class": s });
      span.textContent = LABELS[s];
      legend.appendChild(span);
    });
    box.appendChild(legend);
    root.appendChild(box);
    charts[scope] = { svg: svg, lines: lines, max: max, span: span };
    return charts[scope];
  }

  function draw(scope) {
    var c = chartFor(scope);
    var points = history[scope] || [];
    var top = 1;
    points.forEach(function (p) { SERIES.forEach(function (s) { top = Math.max(top, p.rates[s]); }); });
    c.max.textContent = (Math.round(top * 10) / 10) + "/s";
    // The samples fill the width: the last few seconds at first, then the last 5 minutes.
    var seconds = points.length > 1 ? Math.round((points[points.length - 1].t - points[0].t) / 1000) : 0;
    c.span.textContent = "last " + seconds + " s";
    var n = Math.max(points.length - 1, 1);
    SERIES.forEach(function (s) {
      var coords = points.map(function (p, i) {
        var x = PAD + (W - PAD - 4) * i / n;
        var y = (H - PAD) - (H - PAD - 16) * p.rates[s] / top;
        return x.toFixed(1) + "," + y.toFixed(1);
      });
      c.lines[s].setAttribute("points", coords.join(" "));
    });
  }

  function updateTable(scopes) {
    var body = document.querySelector("#totals tbody");
    if (!body) return;
    while (body.firstChild) body.removeChild(body.firstChild);
    scopes.forEach(function (t) {
      var tr = el("tr", { "data-scope": t.scope });
      var th = el("th", { scope: "row" });
      th.textContent = t.scope;
      tr.appendChild(th);
      SERIES.forEach(function (s) {
        var td = el("td", { "class": "n", "data-series": s });
        td.textContent = String(t[s]);
        tr.appendChild(td);
      });
      body.appendChild(tr);
    });
  }

  function tick() {
    fetch(src, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) {
        if (r.status === 401) { window.location.href = "/console/login"; throw new Error("logged out"); }
        return r.json();
      })
      .then(function (snap) {
        var now = Date.now();
        var totals = {};
        snap.scopes.forEach(function (t) { totals[t.scope] = t; });
        if (last) {
          var dt = Math.max((now - last.t) / 1000, 0.001);
          Object.keys(totals).forEach(function (scope) {
            var prev = last.totals[scope] || {};
            var rates = {};
            SERIES.forEach(function (s) { rates[s] = Math.max(0, (totals[scope][s] - (prev[s] || 0)) / dt); });
            var h = history[scope] || (history[scope] = []);
            h.push({ t: now, rates: rates });
            if (h.length > KEEP) h.shift();
          });
        }
        Object.keys(totals).forEach(draw);
        updateTable(snap.scopes);
        root.setAttribute("data-updated", String(now));
        root.setAttribute("data-samples", String(Object.keys(history).reduce(function (m, k) { return Math.max(m, history[k].length); }, 0)));
        last = { t: now, totals: totals };
      })
      .catch(function () { /* the next tick tries again */ });
  }

  tick();
  setInterval(tick, 2000);
})();
