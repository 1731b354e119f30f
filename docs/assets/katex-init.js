// Renders the formulas pymdownx.arithmatex (generic mode) leaves as \( ... \) / \[ ... \] inside
// .arithmatex elements, with the KaTeX vendored in docs/assets/katex/ (nothing is fetched).
// Material's instant navigation swaps pages without a reload: document$ fires on every page.
function tetherRenderMath() {
  document.querySelectorAll(".arithmatex").forEach(function (element) {
    renderMathInElement(element, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: false,
    });
  });
}
if (typeof document$ !== "undefined") {
  document$.subscribe(tetherRenderMath);
} else {
  document.addEventListener("DOMContentLoaded", tetherRenderMath);
}
