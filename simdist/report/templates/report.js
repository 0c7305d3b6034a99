/* simdist run report: the timeline canvas (zoom, pan, hover) and sortable tables. No network access. */
(function () {
  "use strict";
  var ROW_H = 18, LABEL_W = 120, AXIS_H = 22;

  function sortable(table) {
    var heads = table.querySelectorAll("th");
    heads.forEach(function (th, col) {
      th.addEventListener("click", function () {
        var asc = th.getAttribute("aria-sort") !== "ascending";
        heads.forEach(function (h) { h.removeAttribute("aria-sort"); });
        th.setAttribute("aria-sort", asc ? "ascending" : "descending");
        var num = th.getAttribute("data-type") === "num";
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        rows.sort(function (a, b) {
          var x = a.cells[col], y = b.cells[col];
          var d = num ? parseFloat(x.getAttribute("data-value")) - parseFloat(y.getAttribute("data-value"))
                      : x.textContent.localeCompare(y.textContent);
          return asc ? d : -d;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  }

  function formatUs(us) {
    if (us >= 1e6) return (us / 1e6).toFixed(3) + " s";
    if (us >= 1e3) return (us / 1e3).toFixed(3) + " ms";
    return us.toFixed(3) + " us";
  }

  function formatBytes(b) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
    while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
    return (i ? b.toFixed(1) : b) + " " + units[i];
  }

  /* one timeline: the canvas, its JSON payload (the script element its data-source names) and its tooltip */
  function timeline(canvas, first) {
    var node = document.getElementById(canvas.getAttribute("data-source"));
    if (!node) return;
    var data = JSON.parse(node.textContent);
    var tip = canvas.parentNode.querySelector(".tooltip");
    var rows = data.rows, spans = data.spans;
    var perRow = rows.map(function () { return []; });
    var end = 0;
    spans.forEach(function (s) { perRow[s[0]].push(s); if (s[2] > end) end = s[2]; });
    data.messages.forEach(function (m) { if (m[3] > end) end = m[3]; });
    perRow.forEach(function (list) { list.sort(function (a, b) { return a[1] - b[1]; }); });
    // side-by-side timelines share one time scale: the payload's end (us) when it has one
    end = Math.max(end, data.end || 0) || 1;
    var view = { t0: 0, t1: end };
    // one key per collective call (group and number), shared by every rank's span of it
    function callKey(s) { var d = data.details[s[5]]; return d.seq === undefined ? null : d.group + "#" + d.seq; }
    var highlighted = null;
    var ctx = canvas.getContext("2d");
    var dpr = window.devicePixelRatio || 1;
    var width = 0, height = AXIS_H + rows.length * ROW_H + 4;

    function x(t) { return LABEL_W + (t - view.t0) / (view.t1 - view.t0) * (width - LABEL_W - 8); }
    function t(px) { return view.t0 + (px - LABEL_W) / (width - LABEL_W - 8) * (view.t1 - view.t0); }

    function draw() {
      width = canvas.clientWidth || 800;
      canvas.width = width * dpr; canvas.height = height * dpr; canvas.style.height = height + "px";
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      ctx.clearRect(0, 0, width, height);
      ctx.font = "11px system-ui, sans-serif";
      var drawn = 0, outlined = 0, lastRank = null;
      rows.forEach(function (row, i) {
        var y = AXIS_H + i * ROW_H;
        if (row[0] !== lastRank) {
          ctx.fillStyle = "#dde1e6"; ctx.fillRect(0, y, width, 1);
          ctx.fillStyle = "#1d232b"; ctx.fillText("rank " + row[0], 4, y + 13);
          lastRank = row[0];
        } else if (i % 2) { ctx.fillStyle = "#f6f7f9"; ctx.fillRect(LABEL_W, y, width, ROW_H); }
        ctx.fillStyle = "#5b6572"; ctx.fillText(row[1], 58, y + 13, LABEL_W - 62);
      });
      ctx.save();
      ctx.beginPath(); ctx.rect(LABEL_W, 0, width - LABEL_W, height); ctx.clip();
      spans.forEach(function (s) {
        if (s[2] < view.t0 || s[1] > view.t1) return;
        var x0 = x(s[1]), w = Math.max(1, x(s[2]) - x0), y = AXIS_H + s[0] * ROW_H + 2;
        ctx.fillStyle = data.colours[s[3]];
        ctx.fillRect(x0, y, w, ROW_H - 4);
        if (highlighted !== null && callKey(s) === highlighted) {
          ctx.strokeStyle = "#1d232b"; ctx.lineWidth = 2; ctx.strokeRect(x0 + 1, y + 1, w - 2, ROW_H - 6);
          outlined++;
        }
        if (w > 40) { ctx.fillStyle = "#111"; ctx.fillText(s[4].slice(0, Math.floor(w / 6)), x0 + 2, y + 11); }
        drawn++;
      });
      ctx.strokeStyle = "rgba(29,35,43,0.45)"; ctx.lineWidth = 1;
      data.messages.forEach(function (m) {
        if (m[3] < view.t0 || m[2] > view.t1) return;
        var x0 = x(m[2]), y0 = AXIS_H + m[0] * ROW_H + ROW_H / 2, x1 = x(m[3]), y1 = AXIS_H + m[1] * ROW_H + ROW_H / 2;
        ctx.beginPath(); ctx.moveTo(x0, y0); ctx.lineTo(x1, y1); ctx.stroke();
        var a = Math.atan2(y1 - y0, x1 - x0);
        ctx.beginPath(); ctx.moveTo(x1, y1);
        ctx.lineTo(x1 - 6 * Math.cos(a - 0.4), y1 - 6 * Math.sin(a - 0.4));
        ctx.lineTo(x1 - 6 * Math.cos(a + 0.4), y1 - 6 * Math.sin(a + 0.4));
        ctx.closePath(); ctx.fillStyle = "rgba(29,35,43,0.6)"; ctx.fill();
      });
      ctx.restore();
      ctx.fillStyle = "#5b6572";
      for (var k = 0; k <= 5; k++) {
        var tt = view.t0 + k * (view.t1 - view.t0) / 5, px = x(tt);
        ctx.fillRect(px, AXIS_H - 4, 1, 4);
        ctx.textAlign = k === 0 ? "left" : (k === 5 ? "right" : "center");
        ctx.fillText(formatUs(tt), px, AXIS_H - 8);
      }
      ctx.textAlign = "left";
      canvas.setAttribute("data-rows", String(rows.length));
      canvas.setAttribute("data-spans-drawn", String(drawn));
      canvas.setAttribute("data-view", view.t0.toFixed(3) + " " + view.t1.toFixed(3));
      canvas.setAttribute("data-highlighted", highlighted === null ? "" : highlighted + " " + outlined);
      // where rows and times lie on the canvas (CSS pixels), for tools that point at a span
      canvas.setAttribute("data-layout", JSON.stringify({ label: LABEL_W, axis: AXIS_H, row: ROW_H, right: 8 }));
      if (first) {
        document.body.setAttribute("data-timeline-rows", String(rows.length));
        document.body.setAttribute("data-timeline-spans-drawn", String(drawn));
      }
    }

    function hit(ev) {
      var r = canvas.getBoundingClientRect();
      var px = ev.clientX - r.left, py = ev.clientY - r.top;
      var i = Math.floor((py - AXIS_H) / ROW_H);
      if (i < 0 || i >= rows.length || px < LABEL_W) return null;
      var at = t(px), slack = (view.t1 - view.t0) / width * 2, best = null;
      perRow[i].forEach(function (s) { if (s[1] - slack <= at && at <= s[2] + slack) best = s; });
      return best ? { span: best, px: px, py: py } : null;
    }

    var drag = null;
    canvas.addEventListener("mousedown", function (ev) { drag = { x: ev.clientX, t0: view.t0, t1: view.t1 }; });
    window.addEventListener("mouseup", function () { drag = null; });
    canvas.addEventListener("mousemove", function (ev) {
      if (drag) {
        var dt = (ev.clientX - drag.x) / (width - LABEL_W) * (drag.t1 - drag.t0);
        view.t0 = drag.t0 - dt; view.t1 = drag.t1 - dt; draw(); tip.hidden = true; return;
      }
      var h = hit(ev);
      var key = h ? callKey(h.span) : null;
      if (key !== highlighted) { highlighted = key; draw(); }
      if (!h) { tip.hidden = true; return; }
      var s = h.span, d = data.details[s[5]], row = rows[s[0]];
      var lines = ["rank " + row[0] + " · " + row[1], d.op, formatUs(s[1]) + " → " + formatUs(s[2]) + " (" + formatUs(s[2] - s[1]) + ")"];
      if (d.bytes !== undefined) lines.push("bytes " + formatBytes(d.bytes));
      if (d.algorithm) lines.push("algorithm " + d.algorithm);
      if (d.group !== undefined) lines.push("group " + d.group + (d.seq !== undefined ? ", call #" + d.seq : ""));
      if (d.peer !== undefined) lines.push("peer rank " + d.peer);
      if (d.site) lines.push("at " + d.site);
      tip.textContent = lines.join("\n");
      tip.hidden = false;
      tip.style.left = Math.min(h.px + 12, width - 260) + "px"; tip.style.top = (h.py + 14) + "px";
    });
    canvas.addEventListener("mouseleave", function () {
      tip.hidden = true;
      if (highlighted !== null) { highlighted = null; draw(); }
    });
    canvas.addEventListener("wheel", function (ev) {
      ev.preventDefault();
      var r = canvas.getBoundingClientRect(), at = t(ev.clientX - r.left);
      var f = ev.deltaY > 0 ? 1.25 : 0.8;
      view.t0 = at - (at - view.t0) * f; view.t1 = at + (view.t1 - at) * f; draw();
    }, { passive: false });
    canvas.addEventListener("dblclick", function () { view.t0 = 0; view.t1 = end; draw(); });
    window.addEventListener("resize", draw);
    draw();
  }

  document.querySelectorAll("table.sortable").forEach(sortable);
  document.querySelectorAll("canvas.timeline-canvas").forEach(function (c, i) { timeline(c, i === 0); });
  document.body.setAttribute("data-report-ready", "1");
})();
