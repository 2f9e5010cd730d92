/**
 * The status-bar item: models cached, memory used of the budget, hit rate (as jupyter-resource-usage
 * shows memory). A click opens the side panel. Hooks for tests: `data-testid="overmind-statusbar"`,
 * and `data-state` ("ok", "down", "error", "connecting").
 */

import { Widget } from '@lumino/widgets';

import { OvermindModel } from './model';
import { hitRate } from './panel';

export class OvermindStatus extends Widget {
  constructor(model: OvermindModel, open: () => void) {
    super({ node: document.createElement('button') });
    this.addClass('jp-Overmind-statusItem');
    this.node.dataset.testid = 'overmind-statusbar';
    this.node.addEventListener('click', open);
    this._model = model;
    model.changed.connect(this._update, this);
    this._update();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._model.changed.disconnect(this._update, this);
    super.dispose();
  }

  private _update(): void {
    const view = this._model.view;
    let text: string;
    let title: string;
    if (view.state === 'ok') {
      const n = view.entries_total;
      const rate = hitRate(view.stats).percent;
      text =
        `Overmind: ${n} model${n === 1 ? '' : 's'} · ${view.texts.used} / ${view.texts.budget}` +
        (rate === null ? '' : ` · ${rate}% hits`);
      const kernels = view.kernels.map(k => k.name).join(', ');
      title =
        `${n} cached model${n === 1 ? '' : 's'}, ${view.texts.used} of a ${view.texts.budget} budget, ` +
        `hits / misses ${hitRate(view.stats).text}` +
        (kernels ? `; kernels: ${kernels}` : '') +
        '. Click to open the Overmind panel.';
    } else if (view.state === 'down') {
      text = 'Overmind: no daemon';
      title = 'No overmind daemon runs yet; it starts with %overmind on in a notebook.';
    } else if (view.state === 'error') {
      text = 'Overmind: ?';
      title = view.message;
    } else {
      text = 'Overmind';
      title = 'Asking the server…';
    }
    this.node.dataset.state = view.state;
    this.node.textContent = text;
    this.node.title = title;
  }

  private _model: OvermindModel;
}
