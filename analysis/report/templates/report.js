document.addEventListener('DOMContentLoaded', function () {
  var charts = document.querySelectorAll('svg.chart');
  var marks = 0, visible = 0;
  charts.forEach(function (svg) {
    var n = svg.querySelectorAll('.role-mark > [role="graphics-symbol"]').length;
    var box = svg.getBoundingClientRect();
    svg.setAttribute('data-marks', String(n));
    if (box.width > 0 && box.height > 0) { visible += 1; }
    marks += n;
  });
  document.body.setAttribute('data-rendered',
    charts.length + ' charts, ' + visible + ' visible, ' + marks + ' marks');
});
